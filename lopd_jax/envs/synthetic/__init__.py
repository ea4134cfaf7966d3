"""The synthetic tool-use families (the hub miniature and its domains).
"""
