"""EvalPlus (HumanEval+ and MBPP+) release files, graded as upstream grades them.

Pinned upstream: PyPI ``evalplus`` 0.3.1 (``evalplus/evaluate.py``, ``evalplus/eval/__init__.py``
``untrusted_check``, ``evalplus/gen/util.py`` ``trusted_exec``; per-input time limit
``max(1.0, 4.0 x reference time)``). Data: ``HumanEvalPlus*`` / ``MbppPlus*`` ``.jsonl(.gz)``
rows; MBPP+ inputs get upstream's argument types (:func:`mbpp_inputs`). The answer's code
is graded as it is (upstream's ``solution``). Reference and candidate run the base and the
plus inputs in separate sandboxed runs (:mod:`.evalplus_harness`); outputs are compared
here: ``==`` (dict subclasses as dicts), MBPP's special oracles, then ``numpy.allclose``
with ``atol`` carried from input to input within a part. As in 0.3.1, no ``find_zero``
(HumanEval/32) answer passes (its pass is never recorded; fixed upstream after 0.3.1). A
reference whose outputs cannot be compared makes the task a ``grader_error``. ``base``
passes when every base input does; ``plus`` when base and plus do (the reward). Kept
deviations (none changes a verdict of benchmarks/grader_parity.py's corpus): our sandbox's
limits; values cross as plain data (ints up to 4,000 digits, numpy scalars as Python ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
from typing import Any

from lopd_jax.envs.base import HeldoutTaskSource
from lopd_jax.envs.code.benchmark import GradedCodeEnvironment, read_rows, require
from lopd_jax.envs.code.env import hide_paths
from lopd_jax.envs.code.grading import _results_or_failure
from lopd_jax.envs.code.evalplus_harness import evalplus_program
from lopd_jax.envs.code.sandbox import SandboxConfig, run_python
from lopd_jax.envs.workers.wire import wire_decode, wire_encode
from lopd_jax.core.types import Task

ENV_ID = "evalplus"
KIND = "evalplus"
MIN_TIME_LIMIT = 1.0
GT_TIME_LIMIT_FACTOR = 4.0
FIELDS = {"task_id": str, "prompt": str, "entry_point": str, "canonical_solution": str,
          "base_input": list, "plus_input": list, "atol": (int, float)}
MBPP_OUTPUT_SET_EQ_TASKS = ("similar_elements", "find_char_long", "common_in_nested_lists",
                            "extract_singly", "larg_nnum", "intersection_array",
                            "find_dissimilar", "Diff")
MBPP_OUTPUT_NOT_NONE_TASKS = ("check_str", "text_match_three", "text_starta_endb")
_OUTPUT_CAP = 256 << 20
_expected: dict[str, dict[str, Any]] = {}
_expected_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


# ---------------------------------------------------------------------------------------
# MBPP+ input types (upstream's mbpp_deserialize_inputs, by task number).

def _tuples(x: Any) -> Any:
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


_MBPP_INPUTS = [
    ((2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630,
      726, 740, 744, 809), lambda inp: [tuple(a) for a in inp]),
    ((63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780),
     lambda inp: [[tuple(a) for a in lst] for lst in inp]),
    ((75, 413, 444, 753), lambda inp: [[tuple(a) for a in inp[0]]] + [inp[1]]),
    ((106, 750), lambda inp: [inp[0]] + [tuple(inp[1])]),
    ((115,), lambda inp: [[set(i) if isinstance(i, list) and len(i) else {} for i in inp[0]]]),
    ((124,), lambda inp: (float(inp[0]), complex(inp[1]))),
    ((250, 405, 446, 617, 720, 763, 808), lambda inp: [tuple(inp[0])] + [inp[1]]),
    ((259, 401, 445), lambda inp: [tuple(tuple(a) for a in lst) for lst in inp]),
    ((278,), lambda inp: [tuple(tuple(i) if isinstance(i, list) else i for i in inp[0])]),
    ((307,), lambda inp: [tuple(inp[0])] + [inp[1], inp[2]]),
    ((722,), lambda inp: [{k: tuple(v) for k, v in inp[0].items()}] + inp[1:]),
    ((252,), lambda inp: [complex(inp[0])]),
    ((580, 615, 791), _tuples),
]


def mbpp_inputs(task_id: str, inputs: list) -> list:
    """MBPP+ ``inputs`` with the argument types upstream restores for ``task_id``."""
    number = int(task_id.rsplit("/", 1)[-1])
    for ids, convert in _MBPP_INPUTS:
        if number in ids:
            return [list(convert(inp)) for inp in inputs]
    return inputs


# ---------------------------------------------------------------------------------------
# Loading.

def dataset_of(task_id: str) -> str:
    """``"mbpp"`` for ``Mbpp/N`` ids, else ``"humaneval"``."""
    return "mbpp" if task_id.lower().startswith("mbpp/") else "humaneval"


def load_problems(path: str) -> list[dict[str, Any]]:
    """Validated payloads of an EvalPlus release file; ValueError names file:line and field."""
    out = []
    for lineno, row in read_rows(path):
        where = f"{path}:{lineno}"
        values = {f: require(row, f, t, where) for f, t in FIELDS.items()}
        contract = row.get("contract", "")
        if not isinstance(contract, str):
            raise ValueError(f"{where}: field 'contract' must be str, got {type(contract).__name__}")
        for field in ("base_input", "plus_input"):
            bad = [i for i, x in enumerate(values[field]) if not isinstance(x, list)]
            if bad:
                raise ValueError(f"{where}: field {field!r}: input {bad[0]} is not a list of "
                                 "arguments")
        if not values["base_input"]:
            raise ValueError(f"{where}: field 'base_input' is empty")
        if not math.isfinite(values["atol"]) or values["atol"] < 0:
            raise ValueError(f"{where}: field 'atol' must be a finite number >= 0")
        dataset = dataset_of(values["task_id"])
        if dataset == "mbpp":
            try:
                for field in ("base_input", "plus_input"):
                    values[field] = mbpp_inputs(values["task_id"], values[field])
            except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
                raise ValueError(f"{where}: field {field!r} does not fit MBPP+ task "
                                 f"{values['task_id']}'s argument types ({e})") from None
        out.append({"kind": KIND, "dataset": dataset, "contract": contract, "file": path,
                    **values})
    ids = [p["task_id"] for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: field 'task_id' is not unique")
    return out


def evalplus_instruction(prompt: str) -> str:
    """EvalPlus's chat prompt for a problem (``evalplus/codegen.py``'s instruction)."""
    return ("Please provide a self-contained Python script that solves the following problem "
            f"in a markdown code block:\n```python\n{prompt.strip()}\n```")


# ---------------------------------------------------------------------------------------
# Grading.

PARTS = ("base_input", "plus_input")


def _run_part(payload: dict[str, Any], part: str, code: str, cfg: SandboxConfig, timeout_s: float,
              reference: bool, limits: list[float] | None = None):
    inputs = [wire_encode(list(args)) for args in payload[part]]
    not_none = payload["dataset"] == "mbpp" and payload["entry_point"] in MBPP_OUTPUT_NOT_NONE_TASKS
    program = evalplus_program(code, payload["entry_point"], inputs, reference=reference,
                               not_none=not_none, time_limits=limits)
    cfg = dataclasses.replace(cfg, timeout_s=timeout_s,
                              max_output_bytes=max(cfg.max_output_bytes, _OUTPUT_CAP))
    return run_python(program, config=cfg)


class UngradableTask(RuntimeError):
    """The reference solution cannot produce expected outputs: the task cannot be graded."""


def expected_outputs(payload: dict[str, Any], cfg: SandboxConfig) -> dict[str, Any]:
    """``{"outputs", "types", "ref_times"}`` of the canonical solution on the base then the
    plus inputs (a separate run each, as upstream; cached per problem; each call timed
    inside the sandbox, as upstream's ``trusted_exec(record_time=True)``); raises
    :class:`UngradableTask` naming the task when it does not run cleanly."""
    key = hashlib.sha256(json.dumps([payload["task_id"], payload["prompt"],
                                     payload["canonical_solution"],
                                     wire_encode([list(a) for p in PARTS for a in payload[p]])]
                                    ).encode()).hexdigest()
    with _expected_lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        if key in _expected:
            return _expected[key]
        out: dict[str, list] = {"outputs": [], "types": [], "ref_times": []}
        for part in PARTS:
            n = len(payload[part])
            result = _run_part(payload, part, payload["prompt"] + payload["canonical_solution"], cfg,
                               max(cfg.timeout_s, 60.0 + 0.5 * n), reference=True)
            entries, why = _results_or_failure(result)
            if entries is None or len(entries) != n or any("exc" in e for e in entries):
                bad = why or next((f"input {i}: {e['exc']}" for i, e in enumerate(entries or [])
                                   if "exc" in e), "results missing")
                raise UngradableTask(f"{payload.get('file', '?')}: task {payload['task_id']}: the "
                                      f"canonical solution cannot be compared ({part}): {bad}")
            out["outputs"] += [wire_decode(e["ok"]) for e in entries]
            out["types"] += [str(e.get("ty")) for e in entries]
            out["ref_times"] += [float(e.get("t", 0.0)) for e in entries]
        _expected[key] = out
        return out


def _is_floats(x: Any) -> bool:
    if isinstance(x, float):
        return True
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(i, float) for i in x)


def next_atol(atol: float, exp: Any, dataset: str, entry_point: str) -> float:
    """The tolerance upstream uses from this input on: an ``atol`` of 0 becomes ``1e-6``
    at the first float expected value and stays so for the rest of the part (base or
    plus); ``find_zero`` never changes it."""
    if dataset == "humaneval" and entry_point == "find_zero":
        return atol
    return 1e-6 if atol == 0 and _is_floats(exp) else atol


def _poly(xs: list, x: float) -> float:
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))


def _surface_area(base_edge: float, height: float) -> int:
    """Upstream's oracle for Mbpp/581: a square pyramid of perpendicular ``height``."""
    slant = math.sqrt((base_edge / 2) ** 2 + height ** 2)
    return round(base_edge ** 2 + 4 * (base_edge * slant) / 2)


def _digit_distance(num1: int, num2: int) -> int:
    """Upstream's oracle for Mbpp/558: digits compared after zero-padding to one length."""
    a, b = str(num1), str(num2)
    width = max(len(a), len(b))
    return sum(abs(int(x) - int(y)) for x, y in zip(a.zfill(width), b.zfill(width)))


def output_matches(inp: list, out: Any, exp: Any, atol: float, dataset: str,
                   entry_point: str, same_type: bool | None = None) -> bool:
    """EvalPlus's comparison of one output (see the module docstring); ``out`` and ``exp``
    are plain decoded data, ``same_type`` whether the original values had one type (None:
    compare the decoded types)."""
    try:
        exact = out == exp
        if dataset == "mbpp":
            if entry_point == "are_equivalent":
                exact = True
            elif entry_point == "sum_div":
                exact = exact or out == 0
            elif entry_point == "surface_Area":  # Mbpp/581
                exact = exact or abs(out - _surface_area(*inp)) <= atol
            elif entry_point == "digit_distance_nums":  # Mbpp/558
                exact = exact or out == _digit_distance(*inp)
            elif entry_point in MBPP_OUTPUT_SET_EQ_TASKS:
                exact = set(out) == set(exp)
            elif entry_point in MBPP_OUTPUT_NOT_NONE_TASKS:
                exact = out == exp if isinstance(out, bool) else exp == (out is not None)
        if dataset == "humaneval" and entry_point == "find_zero":
            return abs(_poly(*inp, out)) <= atol
        atol = next_atol(atol, exp, dataset, entry_point)
        if exact or atol == 0:
            return bool(exact)
        if not (type(out) is type(exp) if same_type is None else same_type):
            return False
        if isinstance(exp, (list, tuple)) and len(out) != len(exp):
            return False
        import numpy as np  # only for float outputs: the grading worker stays light
        return bool(np.allclose(out, exp, rtol=1e-07, atol=atol))
    except Exception:  # noqa: BLE001 - an output the comparison cannot handle is wrong
        return False


def part_failure(payload: dict[str, Any], part: str, entries: list[dict[str, Any]],
                 expected: list[Any], types: list[str]) -> int | None:
    """The index of the first input of ``part`` that fails (None: all pass), comparing in
    order with the tolerance carried from input to input as upstream does."""
    atol = payload["atol"]
    if payload["dataset"] == "humaneval" and payload["entry_point"] == "find_zero":
        return 0  # FIND_ZERO_NEVER_PASSES
    for i, (inp, exp) in enumerate(zip(payload[part], expected)):
        entry = entries[i] if i < len(entries) else {"exc": "no result was reported"}
        if "exc" in entry:
            return i
        try:
            out = wire_decode(entry.get("ok"))
        except (ValueError, TypeError, RecursionError, OverflowError):
            return i
        if not output_matches(inp, out, exp, atol, payload["dataset"], payload["entry_point"],
                              same_type=entry.get("ty") == types[i]):
            return i
        atol = next_atol(atol, exp, payload["dataset"], payload["entry_point"])
    return None


def candidate_source(payload: dict[str, Any], code: str) -> str:
    """The program graded: the answer's code as it is, as upstream grades a sample's
    ``solution`` (HumanEval+ and MBPP+ alike)."""
    return code


def time_limits(ref_times: list[float]) -> list[float]:
    """Upstream's per-input limits: ``max(MIN_TIME_LIMIT, GT_TIME_LIMIT_FACTOR * t)`` for
    each input's reference time ``t`` (``untrusted_check``)."""
    return [max(MIN_TIME_LIMIT, GT_TIME_LIMIT_FACTOR * t) for t in ref_times]


def grade(payload: dict[str, Any], code: str, cfg: SandboxConfig
          ) -> tuple[float, str, str, dict[str, int]]:
    """Grade ``code``: (reward = plus verdict, feedback, sandbox status, {base_passed,
    plus_passed, grader_error}); ``grader_error`` is 1 (and the status "grader_error") when
    the reference solution cannot be compared, so the task cannot be graded at all."""
    try:
        ref = expected_outputs(payload, cfg)
    except UngradableTask as e:
        return 0.0, f"Not graded: {e}", "grader_error", {"base_passed": 0, "plus_passed": 0,
                                                          "grader_error": 1}
    source, offset, failures, status = candidate_source(payload, code), 0, {}, "ok"
    for part in PARTS:
        n = len(payload[part])
        sl = slice(offset, offset + n)
        offset += n
        if not n:
            continue
        limits = time_limits(ref["ref_times"][sl])
        # upstream's whole-run limit: min(60, sum of the limits) + 2 s; 5 s here for start-up
        result = _run_part(payload, part, source, cfg, min(60.0, sum(limits)) + 5.0,
                           reference=False, limits=limits)
        status = result.status if result.status != "ok" else status
        entries, why = _results_or_failure(result)
        if entries is None:
            failures[part] = (0, why)
            continue
        bad = part_failure(payload, part, entries, ref["outputs"][sl], ref["types"][sl])
        if bad is not None:
            what = entries[bad].get("exc") if bad < len(entries) else "no result was reported"
            failures[part] = (bad, str(what or "wrong answer"))
    verdicts = {"base_passed": int("base_input" not in failures), "plus_passed": int(not failures)}
    if not failures:
        return 1.0, "All tests passed.", status, verdicts
    part, (i, what) = next(iter(failures.items()))
    inp = payload[part][i] if i < len(payload[part]) else "?"
    return 0.0, (f"Tests failed: {part.split('_')[0]} input {i}: {str(inp)[:300]}: {what[:500]}"
                 ), status, verdicts


# ---------------------------------------------------------------------------------------
# Task source.

class EvalPlusTaskSource(HeldoutTaskSource):
    """HumanEval+ / MBPP+ problems from an EvalPlus release file (evaluation only: every
    task is in "heldout").

    Args:
        path: the release JSONL(.gz) file.
        sandbox: limits for grading runs (the file is hidden from graded programs).
        limit: keep the first ``limit`` problems (None: all).
    """

    env_id = ENV_ID

    def __init__(self, path: str, sandbox: SandboxConfig | None = None,
                 limit: int | None = None):
        """See the class docstring."""
        self.path = os.path.abspath(path)
        self.payloads = load_problems(self.path)[:limit]
        self.sandbox = hide_paths(sandbox or SandboxConfig(timeout_s=30.0), [self.path])
        self._all = [Task(task_id=p["task_id"], env_id=ENV_ID,
                          instruction=evalplus_instruction(p["prompt"]),
                          family=f"{p['dataset']}_plus", payload=p) for p in self.payloads]

    def make_env(self) -> GradedCodeEnvironment:
        """A fresh environment grading with :func:`grade`."""
        return GradedCodeEnvironment(ENV_ID, KIND, grade, self.sandbox)

    def oracle_hint(self, task: Task) -> str:
        """The canonical solution as an answer."""
        p = task.payload
        return f"```python\n{p['prompt']}{p['canonical_solution']}\n```"
