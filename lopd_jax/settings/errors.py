"""Exceptions shared across the layers (so lower layers can raise them without importing
the run-config schema)."""


class ConfigError(ValueError):
    """A configuration problem: unknown key, bad value, unknown config name, resume clash."""


__all__ = ["ConfigError"]
