"""The trusted HumanEval checker: runs a problem's ``check(candidate)`` outside the sandbox.

It runs in an :class:`lopd_jax.envs.workers.isolation.Worker` subprocess, never in the sandbox
nor in the training process. ``candidate`` is a proxy answering each call with the value the
model's function returned *in the sandbox* for the same arguments, decoded from the plain-data
wire format, so an object with an always-true ``__eq__`` cannot reach it; asserts compare
type-strictly (:func:`strict_equal`). One request, :meth:`CheckHandler.handle`, either collects
the calls the test makes (no results yet), returns the verdict, or lists further calls to run
when the test needs an answer it lacks. Asserts run one by one so one pass sees every call;
``random`` is reseeded before every pass so the calls are the same each time.
Details: ``docs/sandbox.md``.
"""

from __future__ import annotations

import ast
import json
import random
from typing import Any

from lopd_jax.envs.workers.wire import wire_decode, wire_encode

MAX_FAILURES_REPORTED = 3


class CandidateError(Exception):
    """The model's function raised (in the sandbox) when called with these arguments."""


def strict_equal(a: Any, b: Any) -> bool:
    """Equality that also requires matching types: bool only equals bool, str only str,
    list/tuple/dict/set only their own kind (recursively); int and float compare by value.
    """
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, complex) or isinstance(b, complex):
        return type(a) is type(b) and a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    return a == b


class _Rewrite(ast.NodeTransformer):
    """Wrap each assert so a failure is recorded, and make its ``==`` type-strict."""

    def __init__(self, source: str):
        self.source = source

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        node.test = _StrictEq().visit(node.test)
        text = (ast.get_source_segment(self.source, node) or "assert ...")[:300]
        handler = ast.ExceptHandler(
            type=ast.Name("Exception", ast.Load()), name="__lopd_e",
            body=[ast.Expr(ast.Call(ast.Name("__lopd_fail__", ast.Load()),
                                    [ast.Constant(node.lineno), ast.Constant(text),
                                     ast.Name("__lopd_e", ast.Load())], []))])
        return ast.Try(body=[node], handlers=[handler], orelse=[], finalbody=[])


class _StrictEq(ast.NodeTransformer):
    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            return ast.Call(ast.Name("__lopd_eq__", ast.Load()),
                            [node.left, node.comparators[0]], [])
        return node


def _compile_test(test: str) -> Any:
    tree = _Rewrite(test).visit(ast.parse(test))
    return compile(ast.fix_missing_locations(tree), "<humaneval test>", "exec")


def run_check(prompt: str, test: str, entry_point: str, calls: list[str],
              results: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Evaluate ``check(candidate)`` with the answered ``calls`` (see the module docstring).

    ``calls`` are JSON texts of ``[wire args, wire kwargs]``; ``results`` the sandbox's
    entries for them. Returns ``{"calls": [...]}`` when other calls are needed, else
    ``{"passed": bool, "why": text}``.
    """
    answered = dict(zip(calls, results))
    missing: list[str] = []
    failures: list[str] = []
    state = {"failed_before_missing": None}

    def candidate(*args: Any, **kwargs: Any) -> Any:
        try:
            key = json.dumps([wire_encode(list(args)), wire_encode(dict(kwargs))])
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"test arguments cannot be sent to the sandbox: {e}") from None
        entry = answered.get(key)
        if entry is None:
            if not missing:
                state["failed_before_missing"] = bool(failures)
            if key not in missing:
                missing.append(key)
            return None
        if "exc" in entry:
            raise CandidateError(str(entry["exc"]))
        return wire_decode(entry["ok"])

    def fail(lineno: int, text: str, error: BaseException) -> None:
        if isinstance(error, AssertionError):
            why = f"AssertionError at test line {lineno}: {text}"
        elif isinstance(error, CandidateError):
            why = f"test line {lineno}: the function raised {error} (in {text[:200]})"
        else:
            why = f"{type(error).__name__} at test line {lineno} ({text}): {error}"
        failures.append(why[:600])

    ns: dict[str, Any] = {"__name__": "__lopd_check__"}
    exec(compile(prompt, "<humaneval prompt>", "exec"), ns)
    ns.update(__lopd_fail__=fail, __lopd_eq__=strict_equal)
    exec(_compile_test(test), ns)
    ns[entry_point] = candidate  # the test may name the function itself (HumanEval/33)
    random.seed(seed)
    try:
        ns["check"](candidate)
    except CandidateError as e:  # outside an assert (e.g. `x = candidate(...)`)
        failures.append(f"the function raised {e}"[:600])
    except Exception as e:  # the test itself broke on the returned values
        failures.append(f"{type(e).__name__}: {e}"[:600])
    if missing and not state["failed_before_missing"]:
        return {"calls": list(calls) + missing}
    if failures:
        return {"passed": False, "why": "\n".join(failures[:MAX_FAILURES_REPORTED])}
    return {"passed": True, "why": ""}


class CheckHandler:
    """Worker-side handler (``lopd_jax.envs.code.checker:CheckHandler``)."""

    def __init__(self) -> None:
        """Make this process unreadable to same-uid processes (no ptrace, no /proc/pid/mem)."""
        try:
            import ctypes  # in the worker only, where prctl may be missing

            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
        except (OSError, AttributeError):
            pass

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"op": "check", prompt, test, entry_point, calls, results}`` -> run_check."""
        if request.get("op") != "check":
            return {"ok": False, "error": f"unknown op {request.get('op')!r}"}
        try:
            reply = run_check(request["prompt"], request["test"], request["entry_point"],
                              list(request.get("calls", [])), list(request.get("results", [])))
        except Exception as e:  # the check itself broke (e.g. a bad problem file)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000]}
        return {"ok": True, **reply}
