"""Grading for the code environments: the verdict is computed outside the sandbox.

:func:`evaluate_code` runs the model's code in :mod:`lopd_jax.envs.code.sandbox` under a harness
(:mod:`lopd_jax.envs.code.harness`) that holds only the test *inputs* and reports the code's
outputs as plain data (:mod:`lopd_jax.envs.workers.wire`); no expected output or pass marker is
ever inside the sandbox. The outputs are compared by a process the code never ran in: HumanEval
by the problem's own ``check`` in the trusted checker (:mod:`lopd_jax.envs.code.checker`, with
further sandbox rounds up to ``MAX_ROUNDS`` when inputs depend on outputs); TACO function-call
and standard-input tests here, type-strictly, floats within ``FLOAT_TOLERANCE``, as TACO/APPS do.

Returns (reward 1.0 or 0.0, feedback text for the model, the last sandbox result). A program
that exits early reports no results and fails. Details: ``docs/sandbox.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from typing import Any

from lopd_jax.envs.workers import pool as worker_pool
from lopd_jax.envs.code.harness import call_program, parse_results, stdin_program
from lopd_jax.envs.workers.isolation import ResourceLimits, WorkerError
from lopd_jax.envs.code.sandbox import SandboxConfig, SandboxResult, run_python
from lopd_jax.envs.workers.wire import wire_decode, wire_encode

MAX_ROUNDS = 3
FLOAT_TOLERANCE = 1e-6
CHECKER = "lopd_jax.envs.code.checker:CheckHandler"
CHECK_TIMEOUT_S = 20.0
_CHECKER_LIMITS = ResourceLimits(memory_bytes=2 * 1024**3, cpu_seconds=None)
_collected: dict[str, list[str]] = {}


class GradingError(Exception):
    """The trusted checker could not evaluate the test (time limit, crash)."""


def humaneval_body(payload: dict[str, Any], code: str) -> str:
    """The prompt (helpers) then the model's code; code without a ``def`` of the entry
    point is taken as the body of the prompt's function."""
    entry = payload["entry_point"]
    if re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.M):
        return payload["prompt"] + "\n    pass\n\n" + code
    return payload["prompt"] + code


def _checker_request(message: dict[str, Any]) -> dict[str, Any]:
    """One request to a pooled checker worker (a fresh one when the pooled one died)."""
    for attempt in range(2):
        worker = worker_pool.acquire(CHECKER, _CHECKER_LIMITS)
        try:
            reply = worker.request(message, CHECK_TIMEOUT_S)
        except WorkerError as e:
            if attempt == 0 and "did not finish in time" not in str(e):
                continue  # the worker had died while idle (e.g. killed): retry on a fresh one
            raise GradingError(f"the test checker failed: {e}") from None
        finally:
            worker_pool.release(worker, _CHECKER_LIMITS)
        if not reply.get("ok"):
            raise GradingError(f"the test checker failed: {reply.get('error')}")
        return reply
    raise AssertionError("unreachable")


def _humaneval_calls(payload: dict[str, Any]) -> list[str]:
    """The calls ``check(candidate)`` makes (collected once per problem text)."""
    key = hashlib.sha256(json.dumps([payload["prompt"], payload["test"],
                                     payload["entry_point"]]).encode()).hexdigest()
    if key not in _collected:
        reply = _checker_request({"op": "check", "prompt": payload["prompt"],
                                  "test": payload["test"], "entry_point": payload["entry_point"],
                                  "calls": [], "results": []})
        _collected[key] = list(reply.get("calls", []))
    return list(_collected[key])


def _run_failure(result: SandboxResult) -> str | None:
    """Why a harness run gave no usable results (None when it did)."""
    if result.status == "timeout":
        return "time limit exceeded"
    if result.status == "memory":
        return "memory limit exceeded"
    if result.status == "output_limit":
        return "the program printed too much output"
    return None


def _results_or_failure(result: SandboxResult) -> tuple[list[dict[str, Any]] | None, str]:
    why = _run_failure(result)
    if why:
        return None, why
    report = parse_results(result.stdout)
    if report is None:
        if result.status == "ok":
            return None, "the program exited before all tests ran"
        tail = result.stderr.strip().splitlines()[-12:]
        return None, "\n".join(tail)[-1500:] or f"exit code {result.returncode}"
    if "error" in report:
        return None, str(report["error"])[:1500]
    entries = report.get("results")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return None, "the program reported malformed results"
    return entries, ""


def _evaluate_humaneval(payload: dict[str, Any], code: str, cfg: SandboxConfig,
                        per_test_s: int) -> tuple[float, str, SandboxResult]:
    body, entry = humaneval_body(payload, code), payload["entry_point"]
    calls = _humaneval_calls(payload)
    result = None
    deadline = time.monotonic() + cfg.timeout_s  # all rounds together get one time limit
    for _ in range(MAX_ROUNDS):
        remaining = deadline - time.monotonic()
        if result is not None and remaining < 0.5:
            return 0.0, "Tests failed: time limit exceeded", result
        program = call_program(body, entry, [json.loads(c) for c in calls], per_test_s,
                               stop_on_exception=False)
        result = run_python(program, config=dataclasses.replace(
            cfg, timeout_s=max(0.5, remaining)))
        entries, why = _results_or_failure(result)
        if entries is None:
            return 0.0, f"Tests failed: {why}", result
        for k, entry_result in enumerate(entries):
            if entry_result.get("timeout"):
                return 0.0, (f"Tests failed: call {k + 1} of {entry}: "
                             f"{str(entry_result.get('exc'))[:300]}"), result
        try:
            reply = _checker_request({"op": "check", "prompt": payload["prompt"],
                                      "test": payload["test"], "entry_point": entry,
                                      "calls": calls, "results": entries})
        except GradingError as e:
            return 0.0, f"Tests failed: {e}", result
        if "calls" not in reply:
            if reply.get("passed") is True:
                return 1.0, "All tests passed.", result
            return 0.0, f"Tests failed: {reply.get('why', '')}", result
        calls = reply["calls"]
    return 0.0, ("Tests failed: the test's inputs kept depending on the outputs; grading "
                 f"stopped after {MAX_ROUNDS} rounds"), result


def _number_close(a: float, b: float) -> bool:
    if a == b:
        return True
    try:
        return abs(a - b) <= FLOAT_TOLERANCE * max(1.0, abs(b))
    except OverflowError:
        return False


def values_match(got: Any, want: Any) -> bool:
    """Type-strict comparison of plain data (bool only equals bool; int/float by value,
    within the float tolerance when either is a float; containers element-wise)."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        if isinstance(got, float) or isinstance(want, float):
            return _number_close(got, want)
        return got == want
    if type(got) is not type(want):
        return False
    if isinstance(got, list):
        return len(got) == len(want) and all(values_match(x, y) for x, y in zip(got, want))
    if isinstance(got, dict):
        return got.keys() == want.keys() and all(values_match(got[k], want[k]) for k in got)
    return got == want


def _as_lists(value: Any, depth: int = 0) -> Any:
    if depth > 200:
        return value
    if isinstance(value, (tuple, list)):
        return [_as_lists(x, depth + 1) for x in value]
    return value


def call_match(got: Any, want: Any) -> bool:
    """TACO/APPS function-call comparison: tuples as lists, a singly wrapped expected value
    accepted, otherwise :func:`values_match`."""
    got = _as_lists(got)
    if values_match(got, want):
        return True
    return isinstance(want, list) and len(want) == 1 and values_match(got, want[0])


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in str(text).strip().splitlines()]


def _tokens_match(got: str, want: str) -> bool:
    a, b = str(got).split(), str(want).split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not _number_close(fx, fy):
            return False
    return True


def stdout_match(got: str, want: Any) -> bool:
    """TACO standard-output comparison (lines, else tokens with the float tolerance)."""
    if isinstance(want, list):
        want = "\n".join(str(w) for w in want)
    return _lines(got) == _lines(want) or _tokens_match(got, want)


def _stdin_text(data: Any) -> str:
    if isinstance(data, list):
        return "\n".join(str(x) for x in data) + "\n"
    return str(data)


def _evaluate_taco(payload: dict[str, Any], code: str, cfg: SandboxConfig,
                   per_test_s: int) -> tuple[float, str, SandboxResult]:
    tests = payload["tests"]
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name")
    if fn_name is None:
        want_len = max(len(str(w)) for w in outputs)
        cap = max(1 << 16, 4 * want_len + 1024)
        budget = min(64 << 20, 2 * cap * len(inputs) + (1 << 16))
        cfg = dataclasses.replace(cfg, max_output_bytes=max(cfg.max_output_bytes, budget))
        program = stdin_program(code, [_stdin_text(x) for x in inputs], per_test_s, cap)
    else:
        calls = [[wire_encode(x if isinstance(x, list) else [x]), wire_encode({})]
                 for x in inputs]
        program = call_program(code, fn_name, calls, per_test_s, method_class="Solution")
    result = run_python(program, config=cfg)
    entries, why = _results_or_failure(result)
    if entries is None:
        return 0.0, f"Tests failed: {why}", result
    for i, (inp, want) in enumerate(zip(inputs, outputs)):
        if i >= len(entries):
            return 0.0, f"Tests failed: test {i}: no result was reported", result
        entry = entries[i]
        if "exc" in entry:
            return 0.0, f"Tests failed: test {i}: {str(entry['exc'])[:1500]}", result
        if fn_name is None:
            got = entry.get("ok")
            if not isinstance(got, str) or entry.get("truncated"):
                return 0.0, f"Tests failed: test {i}: the output is too long", result
            if not stdout_match(got, want):
                return 0.0, (f"Tests failed: test {i}: wrong answer\ninput:\n"
                             f"{str(inp)[:500]}\nexpected:\n{str(want)[:500]}\ngot:\n"
                             f"{got[:500]}"), result
        else:
            try:
                got = wire_decode(entry.get("ok"))
                ok = call_match(got, want)
            except (ValueError, TypeError, RecursionError, OverflowError):
                return 0.0, f"Tests failed: test {i}: the result could not be read", result
            if not ok:
                args = inp if isinstance(inp, list) else [inp]
                return 0.0, (f"Tests failed: test {i}: wrong answer for arguments "
                             f"{str(args)[:500]}: expected {str(want)[:300]}, got "
                             f"{_short_repr(got)}"), result
    return 1.0, "All tests passed.", result


def _short_repr(value: Any) -> str:
    try:
        return str(value)[:300]
    except ValueError:  # an int too long for str()
        return f"<{type(value).__name__}>"


def evaluate_code(payload: dict[str, Any], code: str,
                  config: SandboxConfig | None = None, per_test_s: int = 4
                  ) -> tuple[float, str, SandboxResult]:
    """Run ``code`` against the task ``payload``'s tests (see the module docstring).

    Returns (reward 1.0 or 0.0, feedback text for the model, the sandbox result).
    """
    cfg = config or SandboxConfig()
    kind = payload.get("kind")
    if kind == "humaneval":
        return _evaluate_humaneval(payload, code, cfg, per_test_s)
    if kind == "taco":
        return _evaluate_taco(payload, code, cfg, per_test_s)
    raise ValueError(f"unknown code task kind {kind!r}; expected 'humaneval' or 'taco'")
