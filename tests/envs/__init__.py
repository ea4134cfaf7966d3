"""Tests of `envs`."""
