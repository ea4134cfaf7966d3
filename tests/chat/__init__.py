"""Tests of `chat`."""
