"""LiveCodeBench code generation (``code_generation_lite``), graded as upstream grades it.

Pinned upstream: LiveCodeBench/LiveCodeBench commit ``28fef95ea8c9f7a547c8329f2cd3d32b92c1fa24``
(``lcb_runner/evaluation/testing_util.py``, ``compute_code_generation_metrics.py``, timeout 6).
Data: the release's ``test*.jsonl`` rows; ``private_test_cases`` is JSON or base64 -> zlib ->
pickle of a JSON string, read by an unpickler that refuses every global; functional tests
call ``metadata.func_name``. Each answer runs once in the sandbox the way upstream runs it
(:mod:`.lcb_harness`); outputs are compared here: standard output line by line (stripped;
equal text or equal ``Decimal`` tokens, same line count), return values by ``==`` on the
JSON value (a tuple counts as a list); public then private tests, all must pass.
Kept deviations (none changes a verdict of benchmarks/grader_parity.py's corpus): our
sandbox's memory and time limits; return values cross as plain data (ints up to 4,000
digits, dict subclasses as dicts). Windows ``v5`` / ``v6``: :data:`WINDOWS`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import io
import json
import os
import pickle
import zlib
from decimal import Decimal, InvalidOperation
from typing import Any, Iterable

from lopd_jax.envs.base import HeldoutTaskSource
from lopd_jax.envs.code.benchmark import GradedCodeEnvironment, read_rows, require
from lopd_jax.envs.code.env import hide_paths
from lopd_jax.envs.code.grading import _results_or_failure
from lopd_jax.envs.code.lcb_harness import lcb_program
from lopd_jax.envs.code.sandbox import SandboxConfig, run_python
from lopd_jax.envs.workers.wire import wire_decode, wire_encode
from lopd_jax.core.types import Task

ENV_ID = "livecodebench"
KIND = "livecodebench"
DIFFICULTIES = ("easy", "medium", "hard")
PLATFORMS = ("leetcode", "codeforces", "atcoder")
# [start, end) by contest date. The release README (LiveCodeBench/LiveCodeBench, "Dataset
# Versions") says release_v4 holds problems up to Sep 2024, release_v5 up to Jan 2025 and
# release_v6 up to Apr 2025; its fine-grained versions "v5" / "v6" are those increments.
WINDOWS = {"v5": ("2024-10-01", "2025-02-01"), "v6": ("2025-02-01", "2025-05-01")}
IMPORT_STRING = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
    "from random import *\nfrom statistics import *\nfrom itertools import *\n"
    "from functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\n"
    "from json import *\nfrom builtins import *\nfrom typing import *\nimport string\nimport re\n"
    "import datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\nimport math\n"
    "import random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n")
_FIELDS = {"question_content": str, "starter_code": str, "public_test_cases": str,
           "private_test_cases": str, "metadata": str, "contest_date": str, "difficulty": str,
           "platform": str, "question_id": str}


class _StrOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def decode_private_tests(blob: str, where: str) -> list:
    """The private tests of a row: JSON, or base64 -> zlib -> pickle of a JSON string.

    The unpickler refuses every global (no class, no function), and the unpickled value
    must be a ``str``; anything else raises ValueError naming ``where`` and the field.
    """
    field = f"{where}: field 'private_test_cases'"
    try:
        return json.loads(blob)
    except ValueError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(blob.encode("utf-8"), validate=True))
    except (binascii.Error, zlib.error, ValueError) as e:
        raise ValueError(f"{field} is neither JSON nor base64/zlib data ({e})") from None
    try:
        value = _StrOnlyUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad blob
        raise ValueError(f"{field}: the pickle does not hold a plain string ({e})") from None
    if not isinstance(value, str):
        raise ValueError(f"{field}: the pickle holds a {type(value).__name__}, not a JSON string")
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"{field}: the unpickled string is not JSON ({e})") from None


def _tests(value: Any, field: str, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {field!r} must be a JSON list of tests")
    for i, t in enumerate(value):
        if not (isinstance(t, dict) and isinstance(t.get("input"), str)
                and isinstance(t.get("output"), str)
                and t.get("testtype") in ("stdin", "functional")):
            raise ValueError(f"{where}: field {field!r}: test {i} needs string 'input' and "
                             "'output' and a 'testtype' of 'stdin' or 'functional'")
    return value


def parse_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate one release row and return the task payload (ValueError names the field)."""
    v = {f: require(row, f, t, where) for f, t in _FIELDS.items()}
    if v["difficulty"] not in DIFFICULTIES:
        raise ValueError(f"{where}: field 'difficulty' must be one of {DIFFICULTIES}")
    if v["platform"] not in PLATFORMS:
        raise ValueError(f"{where}: field 'platform' must be one of {PLATFORMS}")
    try:
        date = dt.datetime.fromisoformat(v["contest_date"])
    except ValueError:
        raise ValueError(f"{where}: field 'contest_date' is not an ISO date") from None
    try:
        public = json.loads(v["public_test_cases"])
        metadata = json.loads(v["metadata"])
    except ValueError as e:
        raise ValueError(f"{where}: field 'public_test_cases' or 'metadata' is not JSON ({e})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: field 'metadata' must be a JSON object")
    tests = (_tests(public, "public_test_cases", where)
             + _tests(decode_private_tests(v["private_test_cases"], where), "private_test_cases", where))
    if not tests:
        raise ValueError(f"{where}: the problem has no tests")
    func_name = metadata.get("func_name")
    functional = any(t["testtype"] == "functional" for t in tests)
    if functional and not isinstance(func_name, str):
        raise ValueError(f"{where}: field 'metadata' needs a 'func_name' string for functional tests")
    if functional:
        for i, t in enumerate(tests):
            try:
                t["args"] = [json.loads(line) for line in t["input"].split("\n")]
                t["want"] = json.loads(t["output"])
            except ValueError:
                raise ValueError(f"{where}: test {i}: functional input/output lines must be JSON") from None
    return {"kind": KIND, "question_id": v["question_id"], "question": v["question_content"],
            "title": row.get("question_title", ""), "starter_code": v["starter_code"],
            "difficulty": v["difficulty"], "platform": v["platform"],
            "contest_date": date.date().isoformat(), "func_name": func_name if functional else None,
            "entry_point": func_name if functional else None, "tests": tests}


def lcb_instruction(question: str, starter_code: str) -> str:
    """LiveCodeBench's generation prompt (``lcb_runner/prompts/code_generation.py``)."""
    head = ("You are an expert Python programmer. You will be given a question (problem "
            "specification) and will generate a correct Python program that matches the "
            "specification and passes all tests.\n\n" f"### Question:\n{question}\n\n")
    if starter_code.strip():
        return head + ("### Format: You will use the following starter code to write the solution "
                       "to the problem and enclose your code within delimiters.\n"
                       f"```python\n{starter_code}\n```\n\n### Answer: (use the provided format "
                       "with backticks)\n")
    return head + ("### Format: Read the inputs from stdin solve the problem and write the answer "
                   "to stdout (do not directly test on the sample inputs). Enclose your code within "
                   "delimiters as follows. Ensure that when the python program runs, it reads the "
                   "inputs, runs the algorithm and writes output to STDOUT.\n```python\n"
                   "# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)\n")


# ---------------------------------------------------------------------------------------
# Comparison (outside the sandbox).

def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except (InvalidOperation, ValueError):
        return None


def stdout_matches(got: str, want: str) -> bool:
    """Upstream's ``grade_stdio`` comparison of one test's output."""
    a, b = _stripped_lines(got), _stripped_lines(want)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        dx, dy = _decimals(x), _decimals(y)
        if dx is None or dy is None or dx != dy:
            return False
    return True


def result_matches(got: Any, want: Any) -> bool:
    """Upstream's ``grade_call_based`` comparison (a tuple counts as a list)."""
    if isinstance(got, tuple):
        got = list(got)
    try:
        return bool(got == want)
    except RecursionError:
        return False


def grade(payload: dict[str, Any], code: str, cfg: SandboxConfig, per_test_s: int = 6
          ) -> tuple[float, str, str, dict[str, int]]:
    """Grade ``code`` on the public then private tests: (reward, feedback, status, {})."""
    tests, functional = payload["tests"], payload["func_name"] is not None
    if functional:
        cap, budget = 0, cfg.max_output_bytes * 4
        inputs = [wire_encode(t["args"]) for t in tests]
    else:
        cap = max(1 << 16, 4 * max(len(t["output"]) for t in tests) + 1024)
        budget = min(256 << 20, 2 * cap * len(tests) + (1 << 16))
        inputs = [t["input"] for t in tests]
    program = lcb_program(code, IMPORT_STRING, payload["func_name"], inputs, per_test_s, cap)
    # upstream's whole-run limit: (timeout + 1) per test + 5 s
    run_cfg = dataclasses.replace(cfg, timeout_s=max(cfg.timeout_s, (per_test_s + 1) * len(tests) + 5.0),
                                  max_output_bytes=max(cfg.max_output_bytes, budget))
    result = run_python(program, config=run_cfg)
    entries, why = _results_or_failure(result)
    if entries is None:
        return 0.0, f"Tests failed: {why}", result.status, {}
    for i, test in enumerate(tests):
        if i >= len(entries):
            return 0.0, f"Tests failed: test {i}: no result was reported", result.status, {}
        entry = entries[i]
        if "exc" in entry:
            return 0.0, f"Tests failed: test {i}: {str(entry['exc'])[:1000]}", result.status, {}
        if not functional:
            got = entry.get("ok")
            ok = isinstance(got, str) and not entry.get("truncated") and stdout_matches(got, test["output"])
        else:
            try:
                got = wire_decode(entry.get("ok"))
                ok = result_matches(got, test["want"])
            except (ValueError, TypeError, RecursionError, OverflowError):
                ok = False
        if not ok:
            return 0.0, (f"Tests failed: test {i}: wrong answer\ninput:\n{test['input'][:300]}\n"
                         f"expected:\n{test['output'][:300]}"), result.status, {}
    return 1.0, "All tests passed.", result.status, {}


# ---------------------------------------------------------------------------------------
# Task source.

def _in_window(date: str, window: tuple[str, str] | None) -> bool:
    return window is None or window[0] <= date < window[1]


class LiveCodeBenchTaskSource(HeldoutTaskSource):
    """LiveCodeBench problems from ``code_generation_lite`` JSONL files (evaluation only).

    Args:
        paths: release file(s), or a directory holding ``test*.jsonl``.
        window: ``"v5"``, ``"v6"``, a ``(start, end)`` pair of ISO dates ([start, end)),
            or None (every problem).
        sandbox: limits for grading runs (the files are hidden from graded programs).
        per_test_s: time limit of one test.
        limit: keep the first ``limit`` problems of the window (None: all).
    """

    env_id = ENV_ID

    def __init__(self, paths: str | Iterable[str], window: str | tuple[str, str] | None = None,
                 sandbox: SandboxConfig | None = None, per_test_s: int = 6,
                 limit: int | None = None):
        """See the class docstring."""
        if isinstance(window, str):
            if window not in WINDOWS:
                raise ValueError(f"unknown LiveCodeBench window {window!r}; use {sorted(WINDOWS)} "
                                 "or a (start, end) pair of ISO dates")
            window = WINDOWS[window]
        self.window, self.per_test_s = window, per_test_s
        self.paths = release_files(paths)
        self._all: list[Task] = []
        seen: set[str] = set()
        for path in self.paths:
            for lineno, row in read_rows(path):
                payload = parse_row(row, f"{path}:{lineno}")
                if not _in_window(payload["contest_date"], window) or payload["question_id"] in seen:
                    continue
                seen.add(payload["question_id"])
                self._all.append(Task(
                    task_id=payload["question_id"], env_id=ENV_ID,
                    instruction=lcb_instruction(payload["question"], payload["starter_code"]),
                    family=f"livecodebench/{payload['difficulty']}", payload=payload))
        self._all = self._all[:limit]
        self.sandbox = hide_paths(sandbox or SandboxConfig(timeout_s=30.0), self.paths)

    def make_env(self) -> GradedCodeEnvironment:
        """A fresh environment grading with :func:`grade`."""
        per_test_s = self.per_test_s
        return GradedCodeEnvironment(ENV_ID, KIND, lambda p, c, s: grade(p, c, s, per_test_s),
                                     self.sandbox)


def release_files(paths: str | Iterable[str]) -> list[str]:
    """Absolute paths of the release files: ``paths`` itself, or ``test*.jsonl`` in a directory."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        item = os.path.abspath(os.fspath(item))
        if os.path.isdir(item):
            found = sorted(f for f in os.listdir(item) if f.startswith("test") and f.endswith(".jsonl"))
            if not found:
                raise FileNotFoundError(f"{item}: no test*.jsonl release files")
            out += [os.path.join(item, f) for f in found]
        elif os.path.isfile(item):
            out.append(item)
        else:
            raise FileNotFoundError(f"{item}: no such file or directory")
    return out
