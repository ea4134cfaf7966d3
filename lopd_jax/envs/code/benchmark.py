"""Shared parts of the benchmark code environments (EvalPlus, LiveCodeBench).

* :func:`read_rows`: JSON-lines files (plain or ``.gz``), each row a JSON object; a bad
  line raises ``ValueError`` naming ``file:line``.
* :func:`require`: a row's field, type-checked, or ``ValueError`` naming the file, line
  and field.
* :class:`GradedCodeEnvironment`: the code environment of :mod:`lopd_jax.envs.code.env` (one
  ```python answer, reward 1.0 when every test passes) for a payload kind whose grader
  is given as a function; the grader's extra counters (e.g. EvalPlus's base / plus
  verdicts) land in the episode's ``env_stats``.
* :func:`grade_many`: grade many (payload, code) pairs in parallel worker threads (each
  grading is a sandboxed subprocess), with a progress bar.

Grading itself runs the untrusted code in :mod:`lopd_jax.envs.code.sandbox` through the
harness of :mod:`lopd_jax.envs.code.harness` (inputs only, outputs returned as plain
data) and compares outside the sandbox, as HumanEval and TACO grading do.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from tqdm import tqdm

from lopd_jax.envs.base import EpisodeStats
from lopd_jax.envs.code.env import NO_CODE_FEEDBACK, CodeEnvironment, extract_code
from lopd_jax.envs.code.sandbox import SandboxConfig
from lopd_jax.core.types import AssistantTurn, StepResult

# (payload, code, sandbox config) -> (reward, feedback, status, extra integer counters)
Grader = Callable[[dict, str, SandboxConfig], tuple[float, str, str, dict[str, int]]]


def read_rows(path: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every non-blank line of a JSONL(.gz) file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: a row must be a JSON object")
            rows.append((lineno, row))
    return rows


def require(row: dict[str, Any], field: str, types: type | tuple[type, ...], where: str) -> Any:
    """``row[field]`` when present and of ``types``; else ValueError naming ``where`` and the field."""
    if field not in row:
        raise ValueError(f"{where}: missing field {field!r}")
    value = row[field]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,))):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ValueError(f"{where}: field {field!r} must be {names}, got {type(value).__name__}")
    return value


@dataclasses.dataclass
class BenchStats(EpisodeStats):
    """:class:`EpisodeStats` plus the grader's counters (e.g. ``base_passed``)."""

    extra: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """The counters and the grader's extra counters, flat."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(EpisodeStats)}
        out.update(self.extra)
        return out


class GradedCodeEnvironment(CodeEnvironment):
    """A one-answer code episode graded by ``grader`` (see the module docstring)."""

    stats_type = BenchStats

    def __init__(self, env_id: str, kind: str, grader: Grader,
                 sandbox: SandboxConfig | None = None, max_attempts: int = 1):
        """``kind``: the payload kind this environment accepts."""
        super().__init__(env_id, sandbox, max_attempts)
        self.kinds, self.grader = (kind,), grader

    def step(self, turn: AssistantTurn) -> StepResult:
        """Grade the answer's code; never raises for it."""
        if turn.tool_calls or turn.parse_errors:
            return super().step(turn)  # the code environment's "no tools here" answer
        self._begin_step()
        self.attempts += 1
        code = extract_code(turn.content, self.task.payload.get("entry_point"))
        if code is None:
            reward, feedback, status, extra = 0.0, NO_CODE_FEEDBACK, "no_code", {}
        else:
            reward, feedback, status, extra = self.grader(self.task.payload, code, self.sandbox)
        self.stats.extra = dict(extra)
        return self._attempt_result(reward, feedback, status)


def grade_many(grader: Grader, items: Sequence[tuple[dict, str]], sandbox: SandboxConfig,
               workers: int = 1, desc: str = "grading", progress: bool = True
               ) -> list[tuple[float, str, str, dict[str, int]]]:
    """Grade ``(payload, code)`` pairs with ``workers`` threads (each grading is its own
    sandboxed subprocess); results in input order, with a progress bar."""

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    with tqdm(total=len(items), desc=desc, unit="sample", disable=not progress) as bar:
        def one(item):
            out = grader(item[0], item[1], sandbox)
            bar.update(1)
            return out
        if workers == 1:
            return [one(item) for item in items]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, items))
