"""The stage ledger of a run: which stages finished, and what they recorded.

:class:`StageLedger` records finished stages in ``<workdir>/stages.json`` (through
tensorstore, so ``gs://`` workdirs work too); a restarted run skips them. Stages that
produce state keep it in their own checkpoint directory ``<checkpoints>/<stage>``.
It reads and writes through :func:`lopd_jax.io.files.read_json` / :func:`lopd_jax.io.files.write_json`.
"""

from __future__ import annotations

from typing import Any

from lopd_jax.io.files import read_json, write_json

STAGES_FILE = "stages.json"
STAGE_ORDER = ("warmup", "eval_before", "bank", "cold_start", "lopd", "eval_after", "export", "plot")


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
