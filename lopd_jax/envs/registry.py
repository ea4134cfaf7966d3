"""Task sources by name: ``get_task_source("synthetic", n_train_per_family=8)``.

Sources are registered by import path (``"module:ClassName"``) and imported only when
asked for, so a missing optional dependency of one family never breaks the others.
"""

from __future__ import annotations

import importlib
from typing import Any

from lopd_jax.envs.base import TaskSource

_SOURCES: dict[str, str] = {
    "synthetic": "lopd_jax.envs.synthetic.env:SyntheticTaskSource",
    "envscaler": "lopd_jax.envs.envscaler:EnvScalerTaskSource",
    "bfcl": "lopd_jax.envs.bfcl.env:BFCLTaskSource",
    "humaneval": "lopd_jax.envs.code.env:HumanEvalTaskSource",
    "taco": "lopd_jax.envs.code.env:TacoTaskSource",
}


def register_task_source(name: str, target: str) -> None:
    """Register ``name`` for the TaskSource class at ``target`` ("module:ClassName")."""
    if ":" not in target:
        raise ValueError(f"target must look like 'package.module:ClassName', got {target!r}")
    _SOURCES[name] = target


def known_task_sources() -> list[str]:
    """The registered source names, sorted."""
    return sorted(_SOURCES)


def get_task_source(name: str, **kwargs: Any) -> TaskSource:
    """Build the task source registered as ``name`` with ``kwargs``."""
    if name not in _SOURCES:
        raise ValueError(f"unknown task source {name!r}; known: {known_task_sources()}")
    module_name, cls_name = _SOURCES[name].split(":", 1)
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"task source {name!r} is registered as {_SOURCES[name]} but it "
                          f"could not be loaded: {e}") from e
    source = cls(**kwargs)
    if not isinstance(source, TaskSource):
        raise TypeError(f"{_SOURCES[name]} built a {type(source).__name__}, not a TaskSource")
    return source
