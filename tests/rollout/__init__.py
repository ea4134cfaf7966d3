"""Tests of `rollout`."""
