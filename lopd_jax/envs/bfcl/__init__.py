"""BFCL: the multi-turn function-calling environment and its isolated API worker.
"""
