"""ACEBench: the single-turn (normal) categories and the multi-turn agent category.
"""
