"""The stage ledger of a run: which stages finished, and what they recorded.

:class:`StageLedger` records finished stages in ``<workdir>/stages.json`` (through
tensorstore, so ``gs://`` workdirs work too); a restarted run skips them. Stages that
produce state keep it in their own checkpoint directory ``<checkpoints>/<stage>``.
:func:`read_json` / :func:`write_json` are the small-file IO it (and the saved run
config, :mod:`lopd_jax.settings.run_config`) uses.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import tensorstore as ts

STAGES_FILE = "stages.json"
STAGE_ORDER = ("warmup", "eval_before", "bank", "cold_start", "lopd", "eval_after", "export", "plot")


# ----------------------------------------------------------------------------- small file IO


def _kvstore(directory: str):
    url = directory if "://" in directory else "file://" + os.path.abspath(directory)
    return ts.KvStore.open(url.rstrip("/") + "/").result()


def read_json(directory: str, name: str) -> Any | None:
    """JSON file ``name`` in ``directory`` (local or kvstore URL), or None if absent."""
    res = _kvstore(directory).read(name).result()
    return json.loads(bytes(res.value)) if res.state == "value" else None


def write_json(directory: str, name: str, obj: Any) -> None:
    """Write ``obj`` as JSON file ``name`` in ``directory`` (process 0 only)."""
    if jax.process_index() != 0:
        return
    if "://" not in directory:
        os.makedirs(directory, exist_ok=True)
    _kvstore(directory).write(name, json.dumps(obj, indent=2, sort_keys=True).encode()).result()


class StageLedger:
    """``<workdir>/stages.json``: ``{stage: {"done": true, ...results}}``."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.data: dict[str, dict] = read_json(workdir, STAGES_FILE) or {}

    def done(self, stage: str) -> bool:
        """Whether ``stage`` finished in an earlier (or this) run."""
        return bool(self.data.get(stage, {}).get("done"))

    def result(self, stage: str) -> dict:
        """What ``stage`` recorded when it finished ({} if it has not)."""
        return dict(self.data.get(stage, {}))

    def mark(self, stage: str, **results: Any) -> None:
        """Record ``stage`` as finished, with JSON ``results``."""
        self.data[stage] = {"done": True, **results}
        write_json(self.workdir, STAGES_FILE, self.data)
