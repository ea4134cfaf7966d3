"""Tests of `train`."""
