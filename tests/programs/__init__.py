"""Tests of `programs`."""
