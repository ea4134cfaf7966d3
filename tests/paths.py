"""Paths the tests share: the checkout's root and the fixture data under tests/fixtures."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
