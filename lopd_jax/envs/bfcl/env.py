"""BFCL multi-turn environments on the ``bfcl-eval`` package's shipped data and API classes.

Data: the package's ``BFCL_v*_multi_turn_{base,miss_func,miss_param,long_context}.json``
with their ground truth and tool docs; only its API classes are imported. An episode sends
the user turns one at a time; the assistant's calls run against live instances of the
involved classes, and each turn is checked as BFCL does (state check against the ground
truth's instances, response check on the results). Reward: the fraction of turns passed
(``reward_mode="fraction"``) or 1.0 only if all passed (``"all"``, BFCL's accuracy).
miss_func tasks add the held-out functions' docs at their turn. Calls never raise.

The API instances live in a pooled worker process (:mod:`lopd_jax.envs.bfcl.worker`) under
per-call, per-step and per-check time limits; a call over its limit kills the worker and
the next request rebuilds the episode's state by replay (docs/sandbox.md, "Tool APIs").
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import time
from typing import Any, Sequence

from lopd_jax.envs.workers import pool as worker_pool
from lopd_jax.envs.base import (Environment, EpisodeStats, TaskSource, check_split, tool_message,
                                validate_arguments)
from lopd_jax.envs.workers.isolation import ResourceLimits, Worker, WorkerError, WorkerTimeout
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolCall, ToolSchema

ENV_ID = "bfcl"
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
_BACKEND = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# class -> (module under _BACKEND, function-doc file)
API_CLASSES = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
STATELESS = ("MathAPI",)
ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"
SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of "
    "possible functions. Based on the question, make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, point it out. If the "
    "question lacks the parameters required by the function, also point it out.\n"
    "At each turn, try your best to complete the tasks requested by the user within the "
    "current turn. Keep calling functions until you have fulfilled the request; once you "
    "have no more functions to call, answer in plain text and the turn is complete.")

INSTALL_HINT = "make bfcl (or: pip install -e \".[bfcl]\" -c constraints.txt && pip install --no-deps bfcl-eval==2026.3.23)"
WORKER_HANDLER = "lopd_jax.envs.bfcl.worker:BFCLHandler"
# Wall-clock timeouts bound every request; no lifetime CPU cap (pooled workers live long).
WORKER_LIMITS = ResourceLimits(memory_bytes=2 * 1024**3, cpu_seconds=None)


@functools.lru_cache(maxsize=None)
def data_dir() -> str:
    """The ``bfcl_eval/data`` directory; ImportError with the install line if missing."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the BFCL environment needs the bfcl-eval package: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"bfcl-eval is installed but has no data directory at {path}")
    return path


def _dataset_file(folder: str, category: str) -> str:
    pattern = os.path.join(folder, f"BFCL_v*_multi_turn_{category}.json")
    found = sorted(glob.glob(pattern),
                   key=lambda p: int(re.search(r"BFCL_v(\d+)_", p).group(1)))
    if not found:
        raise FileNotFoundError(f"no BFCL file matches {pattern}; is bfcl-eval complete?")
    return found[-1]


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=None)
def api_class(name: str) -> type:
    """The bfcl API class ``name`` (imported from its func_source_code module only)."""
    if name not in API_CLASSES:
        raise ValueError(f"unknown BFCL API class {name!r}; known: {sorted(API_CLASSES)}")
    data_dir()  # clear error when the package is missing
    module = importlib.import_module(f"{_BACKEND}.{API_CLASSES[name][0]}")
    return getattr(module, name)


_TYPE_MAP = {"dict": "object", "float": "number", "tuple": "array", "list": "array",
             "int": "integer", "str": "string", "bool": "boolean"}


def _to_json_schema(node: Any) -> Any:
    """BFCL's Python-flavoured types (dict, float, tuple, any) as JSON-schema types."""
    if isinstance(node, list):
        return [_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            if value == "any":
                continue
            out[key] = _TYPE_MAP.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: _to_json_schema(v) for k, v in value.items()}
        else:
            out[key] = _to_json_schema(value)
    return out


@functools.lru_cache(maxsize=None)
def _class_docs(name: str) -> tuple[dict[str, Any], ...]:
    path = os.path.join(data_dir(), "multi_turn_func_doc", API_CLASSES[name][1])
    return tuple(_read_jsonl(path))


def tool_schema(doc: dict[str, Any]) -> ToolSchema:
    """An OpenAI tool schema from one BFCL function doc."""
    params = _to_json_schema(doc.get("parameters", {"type": "dict", "properties": {}}))
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"type": "function", "function": {"name": doc["name"],
                                             "description": doc.get("description", ""),
                                             "parameters": params}}


def format_execution_result(value: Any) -> str:
    """A call's result as BFCL renders it (str as is, dict as JSON, else ``str``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def parse_call_string(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """Parse a ground-truth call like ``mv(source='a', destination='b')``.

    Returns (name, positional args, keyword args); ValueError if it is not a plain call
    with literal arguments.
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not a Python call: {text!r} ({e})") from e
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError as e:
        raise ValueError(f"non-literal argument in {text!r}: {e}") from e
    return node.func.id, args, kwargs


def _untyped(schema: ToolSchema) -> ToolSchema:
    """``schema`` with the per-argument types and enums removed (names still checked)."""
    fn = schema["function"]
    params = dict(fn.get("parameters", {}))
    params["properties"] = {k: {} for k in params.get("properties", {})}
    return {"type": "function", "function": {**fn, "parameters": params}}


def _method_table(instances: dict[str, Any]) -> dict[str, Any]:
    """Public method name -> bound method; a later class wins a name clash (as in bfcl)."""
    table = {}
    for inst in instances.values():
        for name, method in inspect.getmembers(inst, predicate=inspect.ismethod):
            if not name.startswith("_"):
                table[name] = method
    return table


def ground_truth_turns(task: Task) -> list[list[ToolCall]]:
    """The task's ground-truth calls per user turn, as ToolCalls with keyword arguments."""
    methods = _method_table({n: api_class(n)() for n in task.payload["involved_classes"]})
    turns = []
    for calls in task.payload["ground_truth"]:
        out = []
        for text in calls:
            name, args, kwargs = parse_call_string(text)
            if args:
                params = [p for p in inspect.signature(methods[name]).parameters]
                kwargs = {**dict(zip(params, args)), **kwargs}
            out.append(ToolCall(name, kwargs))
        turns.append(out)
    return turns


class BFCLEnvironment(Environment):
    """One BFCL multi-turn episode (see the module docstring)."""

    env_id = ENV_ID

    def __init__(self, reward_mode: str = "fraction", strict_types: bool = True,
                 call_timeout_s: float = 2.0, step_timeout_s: float = 3.0,
                 check_timeout_s: float = 10.0, limits: ResourceLimits = WORKER_LIMITS):
        """``reward_mode``: ``"fraction"`` of passed turns, or ``"all"`` (1.0 iff all pass).
        ``strict_types``: reject arguments whose JSON type differs from the doc (False: only
        missing / unknown argument names are rejected, as bfcl's own executor would run
        them). ``call_timeout_s`` bounds one API call, ``step_timeout_s`` all the calls of
        one step, ``check_timeout_s`` one turn's ground-truth check (or a state rebuild);
        ``limits`` are the API worker's resource limits."""
        super().__init__()
        if reward_mode not in ("fraction", "all"):
            raise ValueError(f"reward_mode must be 'fraction' or 'all', got {reward_mode!r}")
        for name, value in (("call_timeout_s", call_timeout_s),
                            ("step_timeout_s", step_timeout_s),
                            ("check_timeout_s", check_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.reward_mode = reward_mode
        self.strict_types = strict_types
        self.call_timeout_s, self.step_timeout_s = call_timeout_s, step_timeout_s
        self.check_timeout_s, self.limits = check_timeout_s, limits
        self.tools: list[ToolSchema] = []
        self._worker: Worker | None = None
        self._broken: str | None = None
        self._deadline = 0.0

    # -- episode state -------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """Start the episode: system prompt + first user turn, tools of the involved APIs."""
        p = task.payload
        if p.get("kind") != "bfcl":
            raise ValueError(f"task {task.task_id!r} is not a BFCL task")
        self.stats = EpisodeStats()
        self.task, self.done = task, False
        self.close()
        self._broken, self._call_log = None, []
        self.turn_index = 0
        self._methods: set[str] = set()
        self._start_worker(replay=False)
        held = {n for names in p.get("missed_function", {}).values() for n in names}
        self._docs = {}
        for cls in p["involved_classes"]:
            for doc in _class_docs(cls):
                self._docs[doc["name"]] = doc  # a later class wins, like the method table
        self._available = [n for n in self._docs if n not in held]
        self.tools = [tool_schema(self._docs[n]) for n in self._available]
        self._schemas = {s["function"]["name"]: s for s in self.tools}
        self.turn_results: list[bool] = []
        self.turn_details: list[dict[str, Any]] = []
        self._calls_this_turn = 0
        self._seen: set[str] = set()
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        messages += self._turn_messages(0)
        return messages, list(self.tools)

    def _turn_messages(self, index: int) -> list[Message]:
        p = self.task.payload
        msgs = [dict(m) for m in p["question"][index] if m.get("role") != "system"]
        added = p.get("missed_function", {}).get(str(index), [])
        if added:
            self._available += [n for n in added if n not in self._available]
            self.tools = [tool_schema(self._docs[n]) for n in self._available]
            self._schemas = {s["function"]["name"]: s for s in self.tools}
            docs = json.dumps([self._docs[n] for n in added if n in self._docs])
            msgs = msgs or [{"role": "user", "content": f"{docs}\n{ADDED_FUNCTIONS_PROMPT}"}]
        if not msgs:  # never send an empty turn
            msgs = [{"role": "user", "content": "Please continue."}]
        return msgs

    # -- calls ---------------------------------------------------------------------------

    def _start_worker(self, replay: bool) -> None:
        """Take an API worker and load the episode (replaying its history when ``replay``)."""
        try:
            self._worker = worker_pool.acquire(WORKER_HANDLER, self.limits)
            message = {"op": "replay" if replay else "init", "payload": self.task.payload,
                       "calls": self._call_log, "turns": self.turn_index}
            reply = self._worker.request(message, self.check_timeout_s)
            if not reply.get("ok"):
                raise WorkerError(reply.get("error", "unknown error"))
            self._methods = set(reply["methods"])
        except WorkerError as e:
            self._broken = (f"the API process could not be (re)started ({e}); reply in plain "
                            "text to end the turn")
            self.close()

    def _ensure_worker(self) -> None:
        """Restart the API worker (rebuilding the episode's state) when an earlier request
        killed it. Raises WorkerError when that is impossible."""
        if self._broken:
            raise WorkerError(self._broken)
        if self._worker is None or not self._worker.alive:
            self._start_worker(replay=True)
            if self._broken:
                raise WorkerError(self._broken)

    def _request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request to the API worker (see :meth:`_ensure_worker`). Raises WorkerError."""
        self._ensure_worker()
        try:
            return self._worker.request(message, timeout_s)
        except WorkerError:
            self._worker = None  # killed by Worker; a replacement starts in the background
            worker_pool.prestart(WORKER_HANDLER, self.limits)
            raise

    def _run_checked_call(self, call: ToolCall) -> Message:
        self._calls_this_turn += 1
        refused = self._admit_call(call)
        if refused:
            return refused
        schema = self._schemas.get(call.name)
        if schema is None or (self._methods and call.name not in self._methods):
            return self._error(call.name, f"unknown tool {call.name!r}; available tools: "
                               f"{sorted(self._schemas)}", "unknown_tools")
        err = validate_arguments(schema if self.strict_types else _untyped(schema),
                                 call.arguments)
        if err:
            return self._error(call.name, err, "invalid_arguments")
        try:
            self._ensure_worker()
        except WorkerError as e:
            return self._error(call.name, f"not run: {e}", "tool_exceptions")
        remaining = self._deadline - time.monotonic()
        if remaining <= 0.05:
            return self._error(call.name, f"not run: this step's calls already took the step "
                               f"time limit (step_timeout_s={self.step_timeout_s:g}); make "
                               "fewer or cheaper calls per step", "tool_exceptions")
        timeout = min(self.call_timeout_s, remaining)
        try:
            reply = self._request({"op": "call", "name": call.name,
                                   "arguments": call.arguments}, timeout)
        except WorkerTimeout:
            return self._error(call.name, f"the call did not finish within {timeout:.1f} s "
                               f"(time limit call_timeout_s={self.call_timeout_s:g}); it was "
                               "stopped and had no effect; use smaller arguments",
                               "tool_exceptions")
        except WorkerError as e:
            return self._error(call.name, f"the call stopped the API process ({e}); it had "
                               "no effect", "tool_exceptions")
        self._call_log.append([call.name, call.arguments])
        if not reply.get("ok"):
            return self._error(call.name, str(reply.get("error", "unknown error")),
                               "tool_exceptions")
        return tool_message(call.name, str(reply.get("result", "")))

    # -- checking ------------------------------------------------------------------------

    def _check_turn(self) -> None:
        """Run the current turn's ground truth (in the worker) and record whether it passed."""
        index = self.turn_index
        try:
            reply = self._request({"op": "check_turn", "index": index,
                                   "calls_this_turn": self._calls_this_turn},
                                  self.check_timeout_s)
            detail = reply["detail"] if reply.get("ok") else {
                "turn": index, "passed": False, "error": reply.get("error")}
        except WorkerError as e:
            detail = {"turn": index, "passed": False, "error": str(e)}
        ok = bool(detail.get("passed"))
        self.turn_results.append(ok)
        self.turn_details.append(detail)

    def _reward(self) -> float:
        n = len(self.task.payload["ground_truth"])
        passed = sum(self.turn_results)
        if self.reward_mode == "all":
            return 1.0 if passed == n and len(self.turn_results) == n else 0.0
        return passed / n if n else 0.0

    def _info(self) -> dict[str, Any]:
        return {"stats": self.stats.as_dict(), "turn": self.turn_index,
                "turn_results": list(self.turn_results)}

    # -- API -----------------------------------------------------------------------------

    def step(self, turn: AssistantTurn) -> StepResult:
        """Tool calls -> tool messages; plain text -> check the turn, send the next one."""
        self._begin_step()
        self._deadline = time.monotonic() + self.step_timeout_s
        if turn.tool_calls or turn.parse_errors:
            obs = [self._error("invalid_tool_call", f"malformed tool call: {e}. Write a tool "
                               "call as a JSON object with a \"name\" string and an "
                               "\"arguments\" object.", "parse_errors")
                   for e in turn.parse_errors]
            obs += [self._run_call(c) for c in turn.tool_calls]
            return StepResult(obs, False, 0.0, self._info())
        self._check_turn()
        self.turn_index += 1
        self._calls_this_turn = 0
        if self.turn_index >= len(self.task.payload["question"]):
            self.done = True
            self.close()
            info = self._info()
            info["turn_details"] = self.turn_details
            return StepResult([], True, self._reward(), info)
        n_tools = len(self.tools)
        obs = self._turn_messages(self.turn_index)
        info = self._info()
        if len(self.tools) != n_tools:
            info["tools"] = list(self.tools)
        return StepResult(obs, False, 0.0, info)

    def finish(self) -> float:
        """Stop here: check the current turn as it stands; unreached turns count as failed."""
        if self.task is None:
            raise RuntimeError("finish() called before reset(task)")
        if not self.done:
            self._check_turn()
            self.done = True
        self.close()
        return self._reward()

    def close(self) -> None:
        """Give the API worker back to the pool (safe to call twice)."""
        worker, self._worker = self._worker, None
        worker_pool.release(worker, self.limits)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class BFCLTaskSource(TaskSource):
    """BFCL multi-turn tasks from the installed ``bfcl-eval`` package.

    Args:
        categories: any of ``base``, ``miss_func``, ``miss_param``, ``long_context``.
        heldout_fraction: share of tasks (by seeded hash of the id) in "heldout"; the
            default 1.0 makes BFCL evaluation-only.
        seed: split seed.
        reward_mode: ``"fraction"`` (of passed turns) or ``"all"``.
        strict_types: reject arguments of the wrong JSON type (see BFCLEnvironment).
        limit: keep only the first ``limit`` tasks of each category (None: all 200).
    """

    env_id = ENV_ID

    def __init__(self, categories: Sequence[str] = ("base",), heldout_fraction: float = 1.0,
                 seed: int = 0, reward_mode: str = "fraction", strict_types: bool = True,
                 limit: int | None = None):
        """See the class docstring."""
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown BFCL categories {unknown}; use some of {CATEGORIES}")
        if not 0.0 <= heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
        if reward_mode not in ("fraction", "all"):
            raise ValueError(f"reward_mode must be 'fraction' or 'all', got {reward_mode!r}")
        self.heldout_fraction, self.seed, self.reward_mode = heldout_fraction, seed, reward_mode
        self.strict_types = strict_types
        folder = data_dir()
        self._all: list[Task] = []
        for category in categories:
            records = _read_jsonl(_dataset_file(folder, category))
            answers = {r["id"]: r["ground_truth"] for r in _read_jsonl(
                _dataset_file(os.path.join(folder, "possible_answer"), category))}
            for rec in records[:limit]:
                if rec["id"] not in answers:
                    raise ValueError(f"BFCL task {rec['id']} has no ground truth")
                unknown_cls = [c for c in rec["involved_classes"] if c not in API_CLASSES]
                if unknown_cls:
                    raise ValueError(f"BFCL task {rec['id']} uses unsupported classes "
                                     f"{unknown_cls}")
                payload = {"kind": "bfcl", "category": category, "question": rec["question"],
                           "initial_config": rec.get("initial_config", {}),
                           "involved_classes": rec["involved_classes"],
                           "missed_function": rec.get("missed_function", {}),
                           "ground_truth": answers[rec["id"]]}
                first = " ".join(m["content"] for m in rec["question"][0]
                                 if m.get("role") == "user")
                family = f"bfcl/{category}/" + "+".join(sorted(rec["involved_classes"]))
                self._all.append(Task(task_id=rec["id"], env_id=ENV_ID, instruction=first,
                                      family=family, payload=payload))

    def all_tasks(self) -> list[Task]:
        """Every loaded task regardless of split, in file order."""
        return list(self._all)

    def tasks(self, split: str) -> list[Task]:
        """Tasks of ``split``: a seeded hash of the task id puts each in one split."""

        check_split(split)
        out = []
        for t in self._all:
            digest = hashlib.sha256(f"{self.seed}:{t.task_id}".encode()).digest()
            held = int.from_bytes(digest[:8], "big") / 2.0**64 < self.heldout_fraction
            if held == (split == "heldout"):
                out.append(t)
        return out

    def make_env(self) -> BFCLEnvironment:
        """A fresh BFCL environment."""
        return BFCLEnvironment(self.reward_mode, self.strict_types)

    def oracle_hint(self, task: Task) -> str:
        """The ground-truth calls of every user turn, as BFCL writes them (``f(a=1)``)."""
        return "\n".join(f"Turn {i + 1}: " + ("; ".join(calls) if calls else "(no call)")
                         for i, calls in enumerate(task.payload["ground_truth"]))
