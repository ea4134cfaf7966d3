"""Isolated worker processes shared by the environments: resource limits, a pool, the
wire format and numeric-state preservation.
"""
