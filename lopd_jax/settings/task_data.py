"""A run's task data, checked before anything is compiled or written.

:func:`resolve_data_paths` makes the local file paths in ``env.kwargs`` absolute (a run
then works from any directory, and its ``config.json`` names the files it used).
:func:`check_task_data` builds the run's task source once, as the run will, and turns
every problem (a missing data path, a file that does not exist or does not parse, a data
package that is not installed) into a :class:`lopd_jax.settings.errors.ConfigError` naming the
``env.kwargs`` key and the section of ``docs/data.md`` that says where the data comes
from and what format it has; ``lopd_jax.train`` exits 2 on it with nothing written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lopd_jax.envs.registry import get_task_source, known_task_sources
from lopd_jax.io.paths import resolve_path
from lopd_jax.settings.errors import ConfigError

DATA_DOC = "docs/data.md"
# env.kwargs keys that hold local data files (lists allowed for TACO's ``paths``)
PATH_KEYS = ("train_path", "heldout_path", "env_items_path", "paths")
# per source: (kwargs of which at least one is required, doc section, a shipped sample)
REQUIRED = {
    "envscaler": (("train_path", "heldout_path"), "EnvScaler scenarios",
                  "env.kwargs.train_path=data/samples/envscaler_train.jsonl "
                  "env.kwargs.heldout_path=data/samples/envscaler_heldout.jsonl"),
    "taco": (("paths",), "TACO problems", "env.kwargs.paths=data/samples/taco_sample.jsonl"),
}
SECTIONS = {"envscaler": "EnvScaler scenarios", "taco": "TACO problems", "bfcl": "BFCL multi-turn",
            "humaneval": "HumanEval", "synthetic": "Synthetic tasks"}


def _section(source: str) -> str:
    return f"{DATA_DOC}, section \"{SECTIONS.get(source, 'Task data')}\""


def resolve_data_paths(cfg):
    """``cfg`` with the local paths of ``env.kwargs`` (:data:`PATH_KEYS`) made absolute."""
    kwargs: dict[str, Any] = dict(cfg.env.kwargs)
    for key in PATH_KEYS:
        v = kwargs.get(key)
        if isinstance(v, str):
            kwargs[key] = resolve_path(v)
        elif isinstance(v, (list, tuple)):
            kwargs[key] = [resolve_path(p) if isinstance(p, str) else p for p in v]
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, kwargs=kwargs))


def check_task_data(cfg) -> None:
    """Build ``cfg``'s task source once; raise :class:`ConfigError` (key, problem, doc section) if it fails."""

    env = cfg.env
    if env.source not in known_task_sources():
        raise ConfigError(f"env.source={env.source!r} is not a task source; use one of {known_task_sources()} "
                          f"({DATA_DOC}).")
    if env.source in REQUIRED:
        keys, _, sample = REQUIRED[env.source]
        if not any(env.kwargs.get(k) for k in keys):
            raise ConfigError(
                f"env.source={env.source} needs its task files: set env.kwargs.{keys[0]}=<file> "
                f"(where the data comes from and its format: {_section(env.source)}). "
                f"To smoke-test the path with the samples shipped in the repository: {sample}")
    for key in PATH_KEYS:
        v = env.kwargs.get(key)
        for p in ([v] if isinstance(v, str) else v if isinstance(v, (list, tuple)) else []):
            if isinstance(p, str) and "://" in p:
                raise ConfigError(f"env.kwargs.{key}={p!r}: task files are read from local disk; copy them "
                                  f"first (gcloud storage cp {p} data/) and point the key at the copy "
                                  f"({_section(env.source)}).")
    try:
        get_task_source(env.source, **env.kwargs)
    except (ValueError, TypeError, OSError, ImportError, KeyError) as e:
        raise ConfigError(f"env.source={env.source} with env.kwargs={env.kwargs}: {e} "
                          f"(the data's source and format: {_section(env.source)}).") from None


__all__ = ["DATA_DOC", "resolve_data_paths", "check_task_data"]
