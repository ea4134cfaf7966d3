"""Worker side of the BFCL environment: the API instances live in an isolated process.

:class:`BFCLHandler` runs inside an :class:`lopd_jax.envs.workers.isolation.Worker` and
holds the model-driven and the ground-truth instances of one episode. Requests: ``init``
(fresh instances from the task's ``initial_config``), ``call`` (one model call; the reply
carries the result or the API's exception as text), ``check_turn`` (run the turn's ground
truth and compare as BFCL does: state and response checks) and ``replay`` (rebuild an
episode on a fresh worker after a kill: the calls that had succeeded, then the checked
turns' ground truth). Every API call runs under
:func:`lopd_jax.envs.workers.numeric_state.preserved_numeric_state`; the caller bounds each
request's wall time.
"""

from __future__ import annotations

import copy
from typing import Any

from lopd_jax.envs.bfcl.env import (STATELESS, _method_table, api_class, format_execution_result,
                                parse_call_string)
from lopd_jax.envs.workers.numeric_state import preserved_numeric_state

MAX_RESULT_CHARS = 100_000


def _public_state(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _build_instances(payload: dict[str, Any]) -> dict[str, Any]:
    long_context = payload["category"] == "long_context"
    out = {}
    for name in payload["involved_classes"]:
        inst = api_class(name)()
        if name not in STATELESS:
            config = copy.deepcopy(payload["initial_config"].get(name, {}))
            inst._load_scenario(config, long_context=long_context)
        out[name] = inst
    return out


def _run(method: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[str | None, str, str]:
    """(result text, "", "") or (None, exception message, exception type) for one call."""
    with preserved_numeric_state():
        try:
            return format_execution_result(method(*args, **kwargs)), "", ""
        except Exception as e:  # inside the API (or an unprintable result)
            try:
                return None, str(e), type(e).__name__
            except Exception:
                return None, "", type(e).__name__


class BFCLHandler:
    """Worker-side state of one BFCL episode at a time (see the module docstring)."""

    def __init__(self) -> None:
        """No episode until ``init``."""
        self.payload: dict[str, Any] | None = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one request (``init``, ``call``, ``check_turn``, ``replay``)."""
        op = request.get("op")
        if op == "init":
            return self._init(request["payload"])
        if op == "replay":
            reply = self._init(request["payload"])
            for name, arguments in request.get("calls", []):
                self._call(name, arguments)
            for index in range(int(request.get("turns", 0))):
                self._ground_truth(index)
            return reply
        if self.payload is None:
            return {"ok": False, "error": "no episode: send init first"}
        if op == "call":
            return self._call(request["name"], request.get("arguments") or {})
        if op == "check_turn":
            return {"ok": True, "detail": self._check_turn(int(request["index"]),
                                                           int(request["calls_this_turn"]))}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _init(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.payload = payload
        with preserved_numeric_state():
            self.model_instances = _build_instances(payload)
            self.gt_instances = _build_instances(payload)
        self.model_methods = _method_table(self.model_instances)
        self.gt_methods = _method_table(self.gt_instances)
        self.model_results: list[str] = []
        return {"ok": True, "methods": sorted(self.model_methods)}

    def _call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        method = self.model_methods.get(name)
        if method is None:
            return {"ok": False, "error": f"unknown tool {name!r}"}
        text, message, kind = _run(method, [], arguments)
        if text is None:
            self.model_results.append(f"Error during execution: {message}")
            return {"ok": False, "error": f"{kind}: {message}"[:MAX_RESULT_CHARS]}
        self.model_results.append(text)
        return {"ok": True, "result": text[:MAX_RESULT_CHARS]}

    def _ground_truth(self, index: int) -> list[str]:
        results = []
        for text in self.payload["ground_truth"][index]:
            try:
                name, args, kwargs = parse_call_string(text)
                out, message, _ = _run(self.gt_methods[name], args, kwargs)
            except Exception as e:  # a bad ground-truth string: its error is the result
                out, message = None, str(e)
            results.append(out if out is not None else f"Error during execution: {message}")
        return results

    def _check_turn(self, index: int, calls_this_turn: int) -> dict[str, Any]:
        gt_calls = self.payload["ground_truth"][index]
        gt_results = self._ground_truth(index)
        detail: dict[str, Any] = {"turn": index}
        if not gt_calls:
            ok = calls_this_turn == 0
            detail["irrelevance"] = ok
        else:
            mismatched = [name for name, gt in self.gt_instances.items()
                          if any(getattr(self.model_instances[name], k, object()) != v
                                 for k, v in _public_state(gt).items())]
            remaining = list(self.model_results)
            missing = []
            for r in gt_results:
                if r in remaining:
                    remaining.remove(r)
                else:
                    missing.append(r)
            ok = not mismatched and not missing
            detail.update(state_mismatch=mismatched, missing_results=missing[:5])
        detail["passed"] = ok
        return detail
