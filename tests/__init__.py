"""The test suite, in folders that mirror the package (tests/<folder>/test_*.py)."""
