"""The environment API every task family implements, plus shared tool-calling helpers.

An :class:`Environment` runs one episode at a time: ``reset(task)`` returns the system and
user messages and the OpenAI tool schemas; ``step(turn)`` takes a parsed assistant turn and
returns a :class:`~lopd_jax.core.types.StepResult`; ``finish()`` scores the state as it
stands when the caller stops the episode at a cap; ``close()`` releases it. Contract:
``step`` never raises for anything the model wrote (errors come back as ``role="tool"``
messages starting with ``"Error:"`` that say how to fix the call); an episode ends, with a
reward in [0, 1], when the assistant answers without a tool call; everything is
deterministic given the task; per-episode :class:`EpisodeStats` ride in
``StepResult.info["stats"]``.

:class:`ToolUseEnvironment` implements the contract for "tools are methods of a state
object" families; :func:`tool_schema_from_function`, :func:`validate_arguments` and
:class:`Toolbox` build schemas from signatures, check calls and execute them.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Sequence

from lopd_jax.chat.call_limits import arguments_limit_error
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolCall, ToolSchema

SPLITS = ("train", "heldout")


def check_split(split: str) -> str:
    """Return ``split`` if it is a known split name, else raise a ValueError naming them."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    return split


class ToolError(Exception):
    """Raised by a tool (or the tool machinery) for an error the model should read.

    The message becomes the tool observation ``"Error: <message>"``; it should say what was
    wrong and how to fix it.
    """


@dataclasses.dataclass
class EpisodeStats:
    """Counters for one episode, for evaluation statistics.

    ``repeated_calls`` counts tool calls identical (same name and arguments) to an earlier
    call of the same episode; ``errors`` counts every error observation (parse errors,
    unknown tools, invalid arguments, exceptions inside tools, timeouts).
    """

    turns: int = 0
    tool_calls: int = 0
    repeated_calls: int = 0
    errors: int = 0
    parse_errors: int = 0
    unknown_tools: int = 0
    invalid_arguments: int = 0
    tool_exceptions: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return dataclasses.asdict(self)


def tool_message(name: str, content: str) -> Message:
    """A ``role="tool"`` observation message for the call named ``name``."""
    return {"role": "tool", "name": name, "content": content}


def format_result(value: Any) -> str:
    """Render a tool's return value as observation text (str as is, else compact JSON)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


def call_key(call: ToolCall) -> str:
    """A canonical string for a call, used to detect repeated identical calls.

    Never raises: arguments JSON cannot encode (an integer beyond Python's 4,300-digit
    conversion limit, nesting beyond the recursion limit, mixed key types) give a key
    from the name and the arguments' identity, i.e. the call never counts as repeated.
    """
    try:
        return str(call.name) + json.dumps(call.arguments, sort_keys=True, default=str)
    except (TypeError, ValueError, RecursionError):
        return f"{call.name!s}\x00unencodable:{id(call.arguments)}"


def check_call(call: ToolCall) -> str | None:
    """The limit (:mod:`lopd_jax.chat.call_limits`) a call breaks, as error text, or None."""
    if not isinstance(call.name, str):
        return "a tool call needs a string name"
    if not isinstance(call.arguments, dict):
        return None  # validate_arguments explains that arguments must be an object
    return arguments_limit_error(call.arguments, f"arguments of {call.name[:80]!r}")


# ---------------------------------------------------------------------------------------
# Tool schemas from Python signatures and docstrings.

_PY_TO_JSON = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", tuple: "array", set: "array", dict: "object", type(None): "null"}
_NAME_TO_JSON = {"int": "integer", "float": "number", "str": "string", "bool": "boolean",
                 "list": "array", "tuple": "array", "dict": "object", "None": "null"}


def _annotation_schema(ann: Any) -> dict[str, Any]:
    """JSON schema for one annotation; ``{}`` (anything goes) when it cannot be mapped."""
    if ann is inspect.Parameter.empty or ann is Any:
        return {}
    if isinstance(ann, str):  # unresolved forward reference: map the simple names
        base = ann.split("[", 1)[0].strip()
        return {"type": _NAME_TO_JSON[base]} if base in _NAME_TO_JSON else {}
    if ann in _PY_TO_JSON:
        return {"type": _PY_TO_JSON[ann]}
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        subs = [_annotation_schema(a) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = dict(subs[0])
            if "type" in out:
                out["type"] = [out["type"], "null"]
            return out
        if all("type" in s and isinstance(s["type"], str) for s in subs):
            return {"type": sorted({s["type"] for s in subs})}
        return {}
    if origin in (list, tuple, set):
        out: dict[str, Any] = {"type": "array"}
        if args and origin is not tuple:
            item = _annotation_schema(args[0])
            if item:
                out["items"] = item
        return out
    if origin is dict:
        return {"type": "object"}
    return {}


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Returns?|Raises|Yields|"
                      r"Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {argument: description}).

    The description is everything before the first section header; argument lines are
    ``name (type): text`` or ``name: text`` under ``Args:``, continuation lines appended.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    desc: list[str] = []
    args: dict[str, str] = {}
    section, current, arg_indent = None, None, None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            section = m.group(1).lower()
            current, arg_indent = None, None
            continue
        if section is None:
            desc.append(line)
        elif section in ("args", "arguments", "parameters", "params"):
            indent = len(line) - len(line.lstrip())
            am = _ARG_LINE.match(line)
            if am and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = am.group(1)
                args[current] = am.group(3).strip()
            elif current and line.strip():
                args[current] = (args[current] + " " + line.strip()).strip()
    return " ".join(" ".join(desc).split()), args


def tool_schema_from_function(fn: Callable[..., Any], name: str | None = None) -> ToolSchema:
    """OpenAI function schema for ``fn`` from its signature, type hints and docstring.

    Parameters without a default are required; ``*args`` is ignored and ``**kwargs`` allows
    extra properties. Unmappable annotations give an unconstrained property.
    """
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references in dataset code
        hints = {}
    description, arg_docs = parse_docstring(inspect.getdoc(fn))
    props: dict[str, Any] = {}
    required: list[str] = []
    extra = False
    for pname, param in sig.parameters.items():
        if pname in ("self", "cls") or param.kind is param.VAR_POSITIONAL:
            continue
        if param.kind is param.VAR_KEYWORD:
            extra = True
            continue
        prop = _annotation_schema(hints.get(pname, param.annotation))
        if arg_docs.get(pname):
            prop["description"] = arg_docs[pname]
        props[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    params: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if not extra:
        params["additionalProperties"] = False
    return {"type": "function", "function": {"name": name or fn.__name__,
                                             "description": description,
                                             "parameters": params}}


def public_methods(obj: Any) -> dict[str, Callable[..., Any]]:
    """The object's public bound methods (names not starting with ``_``), sorted by name."""
    out = {}
    for name in sorted(dir(type(obj))):
        if name.startswith("_"):
            continue
        attr = getattr(type(obj), name, None)
        if isinstance(attr, (property, staticmethod, classmethod)) or not callable(attr):
            continue
        out[name] = getattr(obj, name)
    return out


# ---------------------------------------------------------------------------------------
# Argument validation.

_JSON_CHECKS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _short(value: Any) -> str:
    """``repr(value)`` cut to 200 characters; never raises (huge ints, odd objects)."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:200] + "..."


def _check_value(value: Any, schema: dict[str, Any], where: str) -> str | None:
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {_short(value)}"
    typ = schema.get("type")
    if typ is not None:
        # Dataset schemas sometimes carry Python type names ("str", "int"); map them.
        allowed = [_NAME_TO_JSON.get(t, t) for t in ([typ] if isinstance(typ, str) else typ)]
        if not any(_JSON_CHECKS.get(t, lambda v: True)(value) for t in allowed):
            want = " or ".join(allowed)
            return f"{where} must be of type {want}, got {type(value).__name__} {_short(value)}"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            err = _check_value(item, schema["items"], f"{where}[{i}]")
            if err:
                return err
    return None


def validate_arguments(schema: ToolSchema, arguments: Any) -> str | None:
    """Check ``arguments`` against a tool schema; return an error message or ``None``."""
    fn = schema["function"]
    params = fn.get("parameters", {})
    props: dict[str, Any] = params.get("properties", {})
    if not isinstance(arguments, dict):
        return (f"arguments of {fn['name']!r} must be a JSON object, "
                f"got {type(arguments).__name__}")
    missing = [p for p in params.get("required", []) if p not in arguments]
    if missing:
        return (f"{fn['name']!r} is missing required argument(s) {missing}; "
                f"it takes {sorted(props)}")
    if params.get("additionalProperties", True) is False:
        unknown = [a for a in arguments if a not in props]
        if unknown:
            return f"{fn['name']!r} got unknown argument(s) {unknown}; it takes {sorted(props)}"
    for name, value in arguments.items():
        if name in props:
            err = _check_value(value, props[name], f"argument {name!r}")
            if err:
                return err
    return None


class Toolbox:
    """Executes tool calls against an object's public methods, validating arguments.

    ``call`` raises :class:`ToolError` for unknown names and invalid arguments, and lets
    exceptions from inside the method propagate (the environment turns them into error
    observations).
    """

    def __init__(self, obj: Any):
        """Wrap ``obj``; its public methods become the tools."""
        self.obj = obj
        self.methods = public_methods(obj)
        self.schemas = [tool_schema_from_function(fn, n) for n, fn in self.methods.items()]
        self.by_name = {s["function"]["name"]: s for s in self.schemas}

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Validate and run one call; return the result rendered as text."""
        if name not in self.by_name:
            raise ToolError(f"unknown tool {name!r}; available tools: {sorted(self.by_name)}")
        err = validate_arguments(self.by_name[name], arguments)
        if err:
            raise ToolError(err)
        return format_result(self.methods[name](**arguments))


# ---------------------------------------------------------------------------------------
# Environment API.


class Environment(abc.ABC):
    """One running episode of a task family (see the module docstring for the contract)."""

    env_id: str = ""

    def __init__(self) -> None:
        """Start with fresh statistics and no task."""
        self.stats = EpisodeStats()
        self.task: Task | None = None
        self.done = False

    @abc.abstractmethod
    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """Start an episode of ``task``: return the initial messages and the tool schemas."""

    @abc.abstractmethod
    def step(self, turn: AssistantTurn) -> StepResult:
        """Apply one assistant turn; never raises for malformed model output."""

    @abc.abstractmethod
    def finish(self) -> float:
        """Score the current state (the caller stopped the episode); ends the episode."""

    def _begin_step(self) -> None:
        """Guard the call order of ``step`` and count the turn (every environment does this)."""
        if self.task is None:
            raise RuntimeError("step() called before reset(task)")
        if self.done:
            raise RuntimeError("step() called after the episode ended; call reset(task)")
        self.stats.turns += 1

    def _error(self, name: str, text: str, counter: str) -> Message:
        """An error observation for tool ``name``, counted in ``stats.errors`` and ``counter``."""
        self.stats.errors += 1
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        return tool_message(name, f"Error: {text}")

    def _run_call(self, call: ToolCall) -> Message:
        """The observation of one tool call (:meth:`_run_checked_call`); a host-side bug
        between the text and the tool never crashes the episode: it becomes an error."""
        try:
            return self._run_checked_call(call)
        except Exception as e:  # host-side bug between the text and the tool: never crash
            return self._error(str(call.name), f"the call could not be processed "
                               f"({type(e).__name__})", "invalid_arguments")

    def _run_checked_call(self, call: ToolCall) -> Message:
        """The observation of one tool call (environments whose turns carry tool calls)."""
        raise NotImplementedError(f"{type(self).__name__} does not run tool calls")

    def _admit_call(self, call: ToolCall) -> Message | None:
        """Count a tool call, check its size limits (:func:`check_call`) and note a repeat
        (``stats.repeated_calls``; the subclass keeps ``self._seen`` per episode): the error
        observation when the call is refused, else None."""
        self.stats.tool_calls += 1
        limit = check_call(call)
        if limit:
            return self._error(str(call.name), limit, "invalid_arguments")
        key = call_key(call)
        if key in self._seen:
            self.stats.repeated_calls += 1
        self._seen.add(key)
        return None

    def close(self) -> None:
        """Release any resources (worker processes, sandboxes). Safe to call twice."""

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TaskSource(abc.ABC):
    """A family of tasks: its id, its task lists per split, and an environment factory."""

    env_id: str = ""

    @abc.abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """The tasks of ``split`` ("train" or "heldout"), in a deterministic order."""

    @abc.abstractmethod
    def make_env(self) -> Environment:
        """A fresh environment for one episode."""

    def at_step(self, tasks: Sequence[Task], step: int) -> list[Task]:
        """``tasks`` as they stand at training step ``step`` (0-based LOPD step; held-out
        evaluation after ``n`` steps asks for step ``n``). A source whose tasks change over
        training (the drifting synthetic miniature) re-targets them; default: unchanged."""
        return list(tasks)

    def oracle_hint(self, task: Task) -> str:
        """The task's reference solution or oracle hint as plain text.

        This is the privileged context of fixed-context self-distillation (OPSD's teacher
        sees it in the slot the latents use) and of the premise check
        (:mod:`lopd_jax.premise`). Families that know no solution raise
        ``NotImplementedError`` naming themselves.
        """
        raise NotImplementedError(f"{type(self).__name__} ({self.env_id!r}) has no oracle hint "
                                  f"for task {task.task_id!r}; implement oracle_hint(task)")

    def cluster_key(self, task: Task) -> str:
        """What makes the outcomes of this task dependent on others' (the unit a bootstrap
        over tasks resamples, :mod:`lopd_jax.method.statistics`): by default the task itself
        (a code problem, a BFCL entry); families sharing a hidden parameter name it."""
        return task.task_id


class HeldoutTaskSource(TaskSource):
    """An evaluation-only task source: every loaded task is held out, none trains.

    Subclasses fill ``self._all`` (in file order) and implement :meth:`make_env`.
    """

    _all: list[Task]

    def all_tasks(self) -> list[Task]:
        """Every loaded task, in file order."""
        return list(self._all)

    def tasks(self, split: str) -> list[Task]:
        """All tasks for ``heldout``, none for ``train``."""
        return list(self._all) if check_split(split) == "heldout" else []


class ToolUseEnvironment(Environment):
    """Environment whose tools are calls into some state; implements ``step``.

    Subclasses implement :meth:`_setup` (build the state, return messages and schemas),
    :meth:`_invoke` (run one already-validated call, return observation text; raise
    :class:`ToolError` or any exception for an error) and :meth:`_score` (reward in [0, 1]
    for the current state). When the episode ends on a plain-text answer, that answer is
    in ``self.final_answer`` while ``_score`` runs (``None`` when ``finish()`` ended it).
    """

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """Start an episode of ``task`` (statistics are reset)."""
        self.stats = EpisodeStats()
        self.task = task
        self.done = False
        self.final_answer: str | None = None
        self.reward: float | None = None
        self._seen: set[str] = set()
        messages, schemas = self._setup(task)
        self._schemas = {s["function"]["name"]: s for s in schemas}
        return messages, schemas

    @abc.abstractmethod
    def _setup(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """Build the episode's state for ``task``."""

    @abc.abstractmethod
    def _invoke(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one validated tool call and return its observation text."""

    @abc.abstractmethod
    def _score(self) -> float:
        """Reward in [0, 1] for the current state."""

    def _run_checked_call(self, call: ToolCall) -> Message:
        refused = self._admit_call(call)
        if refused:
            return refused
        schema = self._schemas.get(call.name)
        if schema is None:
            return self._error(call.name, f"unknown tool {call.name!r}; available tools: "
                               f"{sorted(self._schemas)}", "unknown_tools")
        err = validate_arguments(schema, call.arguments)
        if err:
            return self._error(call.name, err, "invalid_arguments")
        try:
            return tool_message(call.name, self._invoke(call.name, call.arguments))
        except ToolError as e:
            return self._error(call.name, str(e), "tool_exceptions")
        except Exception as e:  # a bug or bad state inside the tool: the model reads it
            return self._error(call.name, f"{type(e).__name__}: {e}", "tool_exceptions")

    def _clamped_score(self) -> float:
        return float(min(1.0, max(0.0, self._score())))

    def step(self, turn: AssistantTurn) -> StepResult:
        """Answer one turn: tool observations, or ``done`` with the reward on plain text."""
        self._begin_step()
        if not turn.tool_calls and not turn.parse_errors:
            self.done = True
            self.final_answer = turn.content
            self.reward = self._clamped_score()
            return StepResult([], True, self.reward, {"stats": self.stats.as_dict()})
        obs = [self._error("invalid_tool_call", f"malformed tool call: {e}. Write a tool call "
                           "as a JSON object with a \"name\" string and an \"arguments\" "
                           "object.", "parse_errors") for e in turn.parse_errors]
        obs += [self._run_call(c) for c in turn.tool_calls]
        return StepResult(obs, False, 0.0, {"stats": self.stats.as_dict()})

    def finish(self) -> float:
        """Score the current state and end the episode (returns the same reward again if
        the episode already ended)."""
        if self.task is None:
            raise RuntimeError("finish() called before reset(task)")
        if self.reward is None:
            self.done = True
            self.reward = self._clamped_score()
        return self.reward
