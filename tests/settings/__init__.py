"""Tests of `settings`."""
