"""A run's saved configuration: ``<workdir>/config.json`` and the resume check.

:func:`save_run_config` writes the config of a run into its workdir; when one is already
there (a restarted run) it first checks that only :data:`RESUME_MUTABLE` keys changed,
so a resumed run never silently mixes two configurations. :func:`load_run_config`
reads it back (export, Base + Composer evaluation).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from lopd_jax.io.files import read_json, write_json
from lopd_jax.settings.config import TrainConfig
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.keys import is_inline
from lopd_jax.settings.overrides import from_dict, to_dict

CONFIG_FILE = "config.json"

# Keys a resumed run may change: lengths, schedules, I/O and memory layout (restore
# reshards onto any mesh; remat / attention blocking / logits chunking / micro-batching /
# length buckets change no number beyond fp32 summation order; the rollout engine's
# slots, pages and chunks change no sampled token).
RESUME_MUTABLE = (
    "workdir", "stages.lopd_steps", "stages.eval_every", "stages.eval_tasks",
    "checkpoint.*", "mesh.*", "model.remat_policy",
    "model.attention_impl", "model.attention_block_q", "model.attention_block_kv",
    "steps.logits_chunk", "steps.micro_batch", "lengths.*", "engine.*",
)


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> JSON values of a dataclass tree (dict-valued fields stay whole)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if is_inline(f):
            out.update(flatten(v, prefix))
        elif dataclasses.is_dataclass(v):
            out.update(flatten(v, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = json.loads(json.dumps(v))
    return out


def config_diff(a: TrainConfig, b: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ: ``{key: (a_value, b_value)}``."""
    fa, fb = flatten(a), flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _mutable(key: str, allowed: Sequence[str]) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in allowed)


def check_resume(saved: TrainConfig, current: TrainConfig, allowed: Sequence[str] = RESUME_MUTABLE,
                 allow: Sequence[str] = ()) -> None:
    """Raise :class:`ConfigError` if ``current`` changes a key outside ``allowed`` and ``allow``
    (the keys the user named with ``--allow_config_change``). The message lists each
    differing key with both values and the two ways on."""
    bad = {k: v for k, v in config_diff(saved, current).items() if not _mutable(k, (*allowed, *allow))}
    if bad:
        lines = "\n".join(f"  {k}: saved {v[0]!r}, now {v[1]!r}" for k, v in bad.items())
        raise ConfigError(
            f"this workdir holds a run with a different config ({len(bad)} key(s) differ):\n{lines}\n"
            f"Either start a new run in another workdir (--workdir=...), or keep this run's finished stages "
            f"and apply the new values from its next unfinished stage on with "
            f"--allow_config_change={','.join(bad)} (or rerun with the saved values to resume as it was). "
            f"Keys a resumed run may always change: {list(allowed)}.")


def save_run_config(cfg: TrainConfig, workdir: str | None = None, allow: Sequence[str] = ()) -> bool:
    """Write ``<workdir>/config.json`` (local or ``gs://``); if one exists, check the resume first
    (:func:`check_resume`; ``allow``: keys the user lets differ).

    Returns True when a saved config was found (a resumed run); the file is then
    rewritten with the allowed changes. Only process 0 writes.
    """

    workdir = workdir or cfg.workdir
    resumed = _read(workdir) is not None
    if resumed:
        check_resume(load_run_config(workdir), cfg, allow=allow)
    write_json(workdir, CONFIG_FILE, to_dict(cfg))
    return resumed


def _read(workdir: str) -> Any | None:
    try:
        return read_json(workdir, CONFIG_FILE)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{os.path.join(workdir, CONFIG_FILE)} is not valid JSON ({e}); "
                          "delete it to start over.") from None


def load_run_config(workdir: str) -> TrainConfig:
    """The config saved in ``<workdir>/config.json`` (local or ``gs://``)."""
    data = _read(workdir)
    if data is None:
        raise ConfigError(f"no {CONFIG_FILE} in {workdir}; is this a run directory? Give the --workdir of a training run (python -m lopd_jax.train writes it).")
    return from_dict(data)


__all__ = ["RESUME_MUTABLE", "flatten", "config_diff", "check_resume", "save_run_config", "load_run_config"]
