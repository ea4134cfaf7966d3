"""EnvScaler-format environments: user-supplied scenarios whose code runs isolated.

A scenario (one JSON object; files are a JSON list or JSONL) names an environment class
(its Python source inline or in an ``env_items`` file), the initial attribute values, the
task text and a checklist of ``check_func(final_state)`` functions; the reward is the
fraction of checks that return True. Loading, state and checks follow EnvScaler's
``init_env_class`` / ``run_check_function``; here the episode ends on a plain-text answer
and a tool exception is an error observation. The record format: docs/data.md.

All dataset code (class source, methods, checks) runs in an isolated worker subprocess per
episode (:mod:`lopd_jax.envs.workers.isolation`): import errors, hangs, crashes and
resource-limit kills become error observations and reward 0; ``decimal`` / ``mpmath``
precision is restored after every call and observations are cut at ``MAX_RESULT_CHARS``.
"""

from __future__ import annotations

import copy
import json
import os
import traceback
import types
from typing import Any

from lopd_jax.envs.base import (TaskSource, ToolError, ToolUseEnvironment, Toolbox,
                                check_split, format_result)
from lopd_jax.envs.workers.isolation import ResourceLimits, Worker, WorkerError
from lopd_jax.envs.workers.numeric_state import preserved_numeric_state
from lopd_jax.core.types import Message, Task, ToolSchema

ENV_ID = "envscaler"
# The one layout of EnvScaler files (docs/data.md, "EnvScaler scenarios"): a run's
# env.kwargs point at DIR/envscaler/<file>, and the evaluation suite reads the held-out
# scenarios and env items from its --data_dir the same way.
TRAIN_FILE, HELDOUT_FILE, ENV_ITEMS_FILE = "train.jsonl", "heldout.jsonl", "env_items.json"
MAX_RESULT_CHARS = 100_000
HANDLER = "lopd_jax.envs.envscaler:ScenarioHandler"
_ENV_FIELDS = ("env_class_code", "environment_introduction", "constraints_rules", "tools",
               "env_class_name")
_REQUIRED = ("task_id", "env_class_name", "init_config", "task", "checklist_with_func",
             "env_class_code")


def _read_records(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".jsonl"):
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        records = json.loads(text)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: expected a JSON list (or JSONL) of scenario objects")
    return records


def load_scenarios(path: str, env_items: dict[str, dict[str, Any]] | None = None
                   ) -> list[dict[str, Any]]:
    """Read scenarios from ``path`` and merge in their env items; validate every record."""
    out = []
    for i, rec in enumerate(_read_records(path)):
        scen = dict(rec)
        env_id = scen.get("env_id")
        if "env_class_code" not in scen:
            if env_items is None or env_id not in env_items:
                raise ValueError(f"{path} record {i}: no env_class_code and env_id {env_id!r} "
                                 "is not in the env items; pass env_items_path or inline "
                                 "the environment fields")
            for key in _ENV_FIELDS:
                if key in env_items[env_id] and key not in scen:
                    scen[key] = env_items[env_id][key]
        missing = [k for k in _REQUIRED if k not in scen]
        if missing:
            raise ValueError(f"{path} record {i}: missing field(s) {missing} (see the "
                             "record format in lopd_jax/envs/envscaler.py)")
        checks = scen["checklist_with_func"]
        if not checks or not all(isinstance(c, dict) and isinstance(c.get("check_func"), str)
                                 for c in checks):
            raise ValueError(f"{path} record {i}: checklist_with_func must be a non-empty list "
                             "of {\"check_item\": str, \"check_func\": str} objects")
        if not isinstance(scen["init_config"], dict):
            raise ValueError(f"{path} record {i}: init_config must be an object")
        out.append(scen)
    return out


def system_prompt(scenario: dict[str, Any]) -> str:
    """EnvScaler's environment introduction text (introduction + rules)."""
    rules = "".join(f"- {r}\n" for r in scenario.get("constraints_rules", []))
    return ("# Environment Information\n\n## Brief Introduction:  \n"
            f"{scenario.get('environment_introduction', '')}\n\n"
            f"## Environment Rules / Constraints:  \n{rules}").rstrip() + "\n"


class EnvScalerTaskSource(TaskSource):
    """Scenarios from EnvScaler-format files.

    Args:
        train_path: scenarios for the "train" split (JSON list or ``.jsonl``).
        heldout_path: scenarios for the "heldout" split (optional).
        env_items_path: EnvScaler env items (dict ``env_id -> item``), when scenarios do
            not inline the environment fields.
        call_timeout_s: wall-clock limit per tool call.
        start_timeout_s: limit for starting the worker and building the environment.
        score_timeout_s: limit for running all check functions.
        limits: resource limits of each episode's worker.
        observation_format: "str" (EnvScaler's ``f"{result}"``) or "json".
        limit: keep the first N scenarios of each split (smoke runs); None keeps all.
    """

    env_id = ENV_ID

    def __init__(self, train_path: str | None = None, heldout_path: str | None = None,
                 env_items_path: str | None = None, call_timeout_s: float = 5.0,
                 start_timeout_s: float = 15.0, score_timeout_s: float = 10.0,
                 limits: ResourceLimits = ResourceLimits(), observation_format: str = "str",
                 limit: int | None = None):
        """Load and validate the scenario files (see the class docstring)."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        if train_path is None and heldout_path is None:
            raise ValueError("EnvScalerTaskSource needs train_path and/or heldout_path "
                             "(EnvScaler-format scenario files)")
        if observation_format not in ("str", "json"):
            raise ValueError(f"observation_format must be 'str' or 'json', "
                             f"got {observation_format!r}")
        env_items = None
        if env_items_path is not None:
            with open(env_items_path, encoding="utf-8") as f:
                env_items = json.load(f)
            if not isinstance(env_items, dict):
                raise ValueError(f"{env_items_path}: expected a JSON object env_id -> env item")
        self.settings = {"call_timeout_s": call_timeout_s, "start_timeout_s": start_timeout_s,
                         "score_timeout_s": score_timeout_s, "limits": limits,
                         "observation_format": observation_format}
        self._tasks: dict[str, list[Task]] = {"train": [], "heldout": []}
        seen: set[str] = set()
        for split, path in (("train", train_path), ("heldout", heldout_path)):
            if path is None:
                continue
            for scen in load_scenarios(os.fspath(path), env_items):
                s = check_split(scen.get("split", split))
                tid = str(scen["task_id"])
                if tid in seen:
                    raise ValueError(f"duplicate task_id {tid!r} in {path}")
                seen.add(tid)
                self._tasks[s].append(Task(
                    task_id=tid, env_id=ENV_ID, instruction=scen["task"],
                    family=str(scen.get("family", scen.get("env_id", scen["env_class_name"]))),
                    payload={"scenario": scen}))
        self._tasks = {s: ts[:limit] for s, ts in self._tasks.items()}

    def tasks(self, split: str) -> list[Task]:
        """Scenarios of ``split`` in file order."""
        return list(self._tasks[check_split(split)])

    def make_env(self) -> "EnvScalerEnvironment":
        """A fresh environment (its worker starts at ``reset``)."""
        return EnvScalerEnvironment(**self.settings)

    def oracle_hint(self, task: Task) -> str:
        """EnvScaler scenarios ship no reference trajectory; the hint is the scenario's
        checklist (what the final state must satisfy), one ``check_item`` a line."""
        items = [str(c.get("check_item", "")).strip() for c in task.payload["scenario"]["checklist_with_func"]]
        return "The finished task satisfies:\n" + "\n".join(f"- {i}" for i in items if i)


class EnvScalerEnvironment(ToolUseEnvironment):
    """One episode of an EnvScaler scenario; the scenario's code runs in a worker process.

    ``check_results`` holds, after scoring, one ``{"check_item", "result", "error"}`` dict
    per check.
    """

    env_id = ENV_ID

    def __init__(self, call_timeout_s: float = 5.0, start_timeout_s: float = 15.0,
                 score_timeout_s: float = 10.0, limits: ResourceLimits = ResourceLimits(),
                 observation_format: str = "str"):
        """Store the timeouts and limits used for every episode."""
        super().__init__()
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.score_timeout_s = score_timeout_s
        self.limits = limits
        self.observation_format = observation_format
        self._worker: Worker | None = None
        self._broken: str | None = None
        self.check_results: list[dict[str, Any]] = []

    def _setup(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        self.close()
        if task.env_id != ENV_ID or "scenario" not in task.payload:
            raise ValueError(f"task {task.task_id!r} is not an EnvScaler scenario; build tasks "
                             "with EnvScalerTaskSource")
        scen = task.payload["scenario"]
        self._scenario = scen
        self._broken = None
        self.check_results = []
        messages = [{"role": "system", "content": system_prompt(scen)},
                    {"role": "user", "content": scen["task"]}]
        tools = scen.get("tools")
        try:
            self._worker = Worker(HANDLER, self.limits, self.start_timeout_s)
            reply = self._worker.request(
                {"op": "init", "class_code": scen["env_class_code"],
                 "class_name": scen["env_class_name"], "init_config": scen["init_config"],
                 "observation_format": self.observation_format}, self.start_timeout_s)
            if not reply.get("ok"):
                raise WorkerError(reply.get("error", "unknown error"))
            if not tools:
                tools = reply["tools"]
        except WorkerError as e:
            self._fail(f"the environment failed to start ({e})")
        return messages, copy.deepcopy(tools or [])

    def _fail(self, why: str) -> None:
        self._broken = (f"{why}. Its state is lost and further tool calls cannot run; "
                        "reply in plain text to end the episode.")
        self.close()

    def _run_call(self, call):  # the base validates names/arguments; a dead env short-cuts
        if self._broken is not None:
            self.stats.tool_calls += 1
            return self._error(call.name, self._broken, "tool_exceptions")
        return super()._run_call(call)

    def _invoke(self, name: str, arguments: dict[str, Any]) -> str:
        assert self._worker is not None
        try:
            reply = self._worker.request({"op": "call", "name": name, "arguments": arguments},
                                         self.call_timeout_s)
        except WorkerError as e:
            self._fail(f"the call {name!r} stopped the environment ({e})")
            raise ToolError(self._broken) from None
        if not reply.get("ok"):
            raise ToolError(reply.get("error", "unknown error"))
        return str(reply["result"])

    def _score(self) -> float:
        checks = self._scenario["checklist_with_func"]
        if self._broken is not None or self._worker is None:
            self.check_results = [{"check_item": c.get("check_item", ""), "result": None,
                                   "error": self._broken or "no environment"} for c in checks]
            return 0.0
        try:
            reply = self._worker.request({"op": "score", "checks": [c["check_func"]
                                                                    for c in checks]},
                                         self.score_timeout_s)
            results = reply.get("results") if reply.get("ok") else None
            error = reply.get("error")
        except WorkerError as e:
            results, error = None, str(e)
        finally:
            self.close()
        if not isinstance(results, list) or len(results) != len(checks):
            results = [{"result": None, "error": error or "scoring failed"} for _ in checks]
        self.check_results = [{"check_item": c.get("check_item", ""), **r}
                              for c, r in zip(checks, results)]
        return sum(r["result"] is True for r in results) / len(checks)

    def close(self) -> None:
        """Stop this episode's worker process."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()


# ---------------------------------------------------------------------------------------
# Worker side (runs inside the isolated subprocess).


def _state_info(instance: Any) -> dict[str, Any]:
    return copy.deepcopy({k: v for k, v in vars(instance).items()
                          if not (k.startswith("__") and k.endswith("__"))})


def _short_error(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"line {f.lineno}" for f in reversed(frames)
                  if f.filename == "<env_class_code>"), "")
    return f"{type(e).__name__}: {e}" + (f" (env code {where})" if where else "")


class ScenarioHandler:
    """Worker-side handler: builds the scenario's environment, runs calls and checks."""

    def __init__(self) -> None:
        """No environment until an ``init`` request."""
        self.instance: Any = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one request: ``init``, ``call``, ``score`` or ``state``."""
        op = request.get("op")
        try:
            if op == "init":
                return self._init(request)
            if self.instance is None:
                return {"ok": False, "error": "environment not initialised"}
            if op == "call":
                return self._call(request["name"], request.get("arguments", {}))
            if op == "score":
                return {"ok": True, "results": [self._check(src) for src in request["checks"]]}
            if op == "state":
                return {"ok": True, "state": json.loads(json.dumps(_state_info(self.instance),
                                                                   default=str))}
            return {"ok": False, "error": f"unknown op {op!r}"}
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            return {"ok": False, "error": _short_error(e)}

    def _init(self, request: dict[str, Any]) -> dict[str, Any]:
        module = types.ModuleType("envscaler_scenario")
        exec(compile(request["class_code"], "<env_class_code>", "exec"), module.__dict__)
        name = request["class_name"]
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            return {"ok": False, "error": f"class {name!r} is not defined by env_class_code"}
        config = copy.deepcopy(request["init_config"])
        try:
            instance = cls(copy.deepcopy(config))
        except TypeError:
            instance = cls()
        for key, value in config.items():
            setattr(instance, key, value)
        self.instance = instance
        self.format = request.get("observation_format", "str")
        self.initial_state = _state_info(instance)
        self.toolbox = Toolbox(instance)
        return {"ok": True, "tools": self.toolbox.schemas}

    def _call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        method = self.toolbox.methods.get(name)
        if method is None:
            return {"ok": False, "error": f"the environment has no method {name!r}"}
        with preserved_numeric_state():
            try:
                result = method(**arguments)
                text = format_result(result) if self.format == "json" else f"{result}"
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                return {"ok": False, "error": _short_error(e)}
        return {"ok": True, "result": text[:MAX_RESULT_CHARS]}

    def _check(self, source: str) -> dict[str, Any]:
        scope = {"__builtins__": __builtins__, "initial_state": copy.deepcopy(self.initial_state)}
        try:
            exec(compile(source, "<check_func>", "exec"), scope)
            fn = scope.get("check_func")
            if not callable(fn):
                return {"result": None, "error": "check source defines no check_func"}
            result = fn(_state_info(self.instance))
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            return {"result": None, "error": f"{type(e).__name__}: {e}"}
        if not isinstance(result, bool):
            return {"result": None, "error": f"check_func returned {type(result).__name__}, "
                                             "not bool"}
        return {"result": result, "error": None}
