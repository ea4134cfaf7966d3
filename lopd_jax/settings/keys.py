"""How a config section's fields map to its dotted keys.

A section may hold a settings object of its own as an **inline** field (:func:`inline`): the
object's fields then read as the section's own keys, in overrides, ``config.json`` and the
resume check (``steps.margin`` for ``StepConfig.loss.margin``, ``rollout.temperature`` for
``RolloutSection.sampling.temperature``), so objects compose without renaming any key.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

__all__ = ["inline", "is_inline", "key_paths"]


def inline(default: Any) -> Any:
    """A dataclass field holding ``default`` (a frozen dataclass) whose fields are keys of
    the enclosing section."""
    return dataclasses.field(default=default, metadata={"inline": True})


def is_inline(field: dataclasses.Field) -> bool:
    """Whether ``field`` was declared with :func:`inline`."""
    return bool(field.metadata.get("inline"))


def key_paths(cls: type) -> dict[str, tuple[str, ...]]:
    """The keys of section class ``cls`` -> the attribute path each one names
    (``{"margin": ("loss", "margin"), "eta_beta": ("eta_beta",), ...}``)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(cls):
        sub = {f.name: ()} if not is_inline(f) else key_paths(hints[f.name])
        for key, path in sub.items():
            if key in out:
                raise TypeError(f"{cls.__name__}: key {key!r} is defined twice (inline fields clash)")
            out[key] = (f.name, *path)
    return out
