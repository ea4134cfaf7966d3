"""The named run configs: ``configs/<name>.py`` each define ``CONFIG`` (or ``config()``), a
:class:`~lopd_jax.settings.config.TrainConfig`; :func:`load_config` finds one by name.

This package sits above :mod:`lopd_jax.settings` (the schema it fills in); nothing in
the settings imports it.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re

from lopd_jax.settings.config import TrainConfig
from lopd_jax.settings.errors import ConfigError


def known_configs() -> list[str]:
    """Names of the config modules of this package (importable from any directory)."""

    names = {m.name for m in pkgutil.iter_modules(__path__)}
    return sorted(n for n in names if not n.startswith("_"))


def load_config(name: str) -> TrainConfig:
    """``configs/<name>.py``'s ``CONFIG`` (or ``config()``), validated."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name or "") or name not in known_configs():
        close = difflib.get_close_matches(name or "", known_configs(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown config {name!r}{hint}; known configs: {known_configs()}")
    module = importlib.import_module(f"configs.{name}")
    if hasattr(module, "CONFIG"):
        cfg = module.CONFIG
    elif callable(getattr(module, "config", None)):
        cfg = module.config()
    else:
        raise ConfigError(f"configs/{name}.py defines neither CONFIG nor config(); add one returning a TrainConfig.")
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"configs/{name}.py gave a {type(cfg).__name__}, not a TrainConfig.")
    return cfg


__all__ = ["known_configs", "load_config"]
