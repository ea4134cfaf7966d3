"""Tests of `method`."""
