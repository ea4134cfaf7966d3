"""ACEBench's agent categories: ``agent_multi_step`` (the model acts alone) and
``agent_multi_turn`` (a simulated user), on the scenarios of
:mod:`lopd_jax.envs.acebench.scenarios`, graded on the end state and on the milestones.

The episode follows upstream's ``multi_step_inference`` / ``multi_turn_inference``: the
agent writes calls as text, parsed without ``eval`` and run against the scenario objects;
results come back as a user message. In multi-turn, a message that is not a call goes to
the simulated user (any :data:`UserSimulator`; the suite passes the policy itself or
``--acebench_user_model``). The episode ends on ``finish conversation`` or after
:data:`MAX_MESSAGES` messages. Reward 1.0 when the end state matches the ground truth;
process accuracy is the share of milestones met in order. Data format, grading and the
deviations from upstream: docs/evaluation.md, "ACEBench".
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

from lopd_jax.envs.acebench import prompts
from lopd_jax.envs.acebench.checker import AnswerFormatError, decode_calls
from lopd_jax.envs.acebench.scenarios import SAVED_ATTRS, build_instances, end_state, execute
from lopd_jax.envs.base import Environment
from lopd_jax.envs.code.benchmark import BenchStats
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolSchema

AGENT_CATEGORIES = ("agent_multi_step", "agent_multi_turn")
MAX_MESSAGES = 40  # upstream's max_dialog_turns: messages of the dialogue after the first
FINISH = "finish conversation"
NOT_A_CALL = "Please do not ask me any questions, use the known conditions to solve the problem"
UserSimulator = Callable[[list[Message]], str]
"""A simulated user: the chat so far (system = upstream's user prompt with the instruction;
the simulated user's own lines as ``assistant``, the agent's as ``user``) -> its next line."""


# ---------------------------------------------------------------------------------------
# Data files.

def read_rows(path: str) -> list[tuple[str, dict]]:
    """The JSON-object lines of an ACEBench data file as ``(path:line, row)``; a missing file
    or a line that is not a JSON object raises an error naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; upstream publishes it at "
                                "https://github.com/ACEBench/ACEBench/tree/main/data_all/data_en")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                where = f"{path}:{n}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: not a JSON object")
                out.append((where, row))
    return out


def need_field(row: dict, name: str, kind: type | tuple, where: str) -> Any:
    """``row[name]``, or a ValueError at ``where`` when it is missing or not a ``kind``."""
    if name not in row:
        raise ValueError(f"{where}: missing field {name!r}")
    if not isinstance(row[name], kind):
        raise ValueError(f"{where}: field {name!r} must be {getattr(kind, '__name__', kind)}, "
                         f"got {type(row[name]).__name__}")
    return row[name]


def _check_milestones(stones: list, where: str) -> None:
    flat = all(isinstance(s, str) for s in stones)
    nested = stones and all(isinstance(s, list) and all(isinstance(x, str) for x in s) for s in stones)
    if not (flat or nested):
        raise ValueError(f"{where}: field 'mile_stone' must be a list of call strings or a list of such lists")


def load_agent_category(data_dir: str, category: str) -> list[Task]:
    """The tasks of one agent category from ``data_dir`` (upstream's ``data_en``).

    FileNotFoundError names a missing file and where upstream publishes it; ValueError
    names ``file:line`` and the field of a malformed row, before anything runs.
    """
    if category not in AGENT_CATEGORIES:
        raise ValueError(f"unknown ACEBench agent category {category!r}; known: {list(AGENT_CATEGORIES)}")
    qpath = os.path.join(data_dir, f"data_{category}.json")
    apath = os.path.join(data_dir, "possible_answer", f"data_{category}.json")
    questions, answers = read_rows(qpath), read_rows(apath)
    truth = {}
    for where, row in answers:
        rid = need_field(row, "id", str, where)
        gt = need_field(row, "ground_truth", (list, dict), where)
        for entry in gt if isinstance(gt, list) else [gt]:
            if not (isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry.values())), dict)):
                raise ValueError(f"{where}: field 'ground_truth' must be a list of {{class: {{attribute: value}}}}")
        stones = need_field(row, "mile_stone", list, where)
        _check_milestones(stones, where)
        truth[rid] = (gt if isinstance(gt, list) else [gt], stones)
    tasks = []
    for where, row in questions:
        rid = need_field(row, "id", str, where)
        question = need_field(row, "question", str, where)
        config = need_field(row, "initial_config", dict, where)
        involved = need_field(row, "involved_classes", list, where)
        unknown = [c for c in involved if c not in SAVED_ATTRS]
        if not involved or unknown:
            raise ValueError(f"{where}: field 'involved_classes' must name classes of {sorted(SAVED_ATTRS)}, "
                             f"got {involved}")
        functions = need_field(row, "function", list, where)
        if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
            raise ValueError(f"{where}: field 'function' must be a list of API docs with a 'name'")
        if rid not in truth:
            raise ValueError(f"{where}: id {rid!r} has no 'ground_truth' row in {apath}")
        tasks.append(Task(task_id=rid, env_id="acebench", instruction=question, family=category,
                          payload={"category": category, "question": question, "initial_config": config,
                                   "involved_classes": involved, "functions": functions,
                                   "ground_truth": truth[rid][0], "mile_stone": truth[rid][1]}))
    return tasks


# ---------------------------------------------------------------------------------------
# Parsing and grading.

def parse_agent_calls(text: str) -> list[dict[str, dict]]:
    """Upstream's ``decode_function_list``: a leading space dropped, brackets added when
    missing, ``[]'`` stripped from both ends, the rest parsed as one call or a tuple of
    calls (keyword arguments only). AnswerFormatError when it is not that."""
    func = text[1:] if text.startswith(" ") else text
    func = ("" if func.startswith("[") else "[") + func + ("" if func.endswith("]") else "]")
    inner = func.strip("[]'")
    if not inner.strip():
        raise AnswerFormatError("no call")
    return decode_calls(f"[{inner}]")


def check_end_state(state: list[dict], truth: list[dict]) -> dict[str, Any]:
    """Upstream's end-to-end check of ``state`` (:func:`acebench_scenarios.end_state`)
    against the ground truth; ``{"valid", "error_type", "errors"}``."""
    if len(state) != len(truth):
        return {"valid": False, "error_type": "wrong number of class",
                "errors": [f"{len(state)} classes in the end state, {len(truth)} expected"]}
    errors, last_valid = [], True
    for expected in truth:
        match = next((s for s in state if set(s) == set(expected)), None)
        if match is not None:  # no match: upstream reuses the previous verdict (never a new failure)
            (name, want), = expected.items()
            found = next(iter(match.values()))
            new = []
            for attr, value in found.items():
                if attr not in want:
                    new.append(f"class({name}) attributes({attr}) missing in possible_answer.")
                elif isinstance(want[attr], dict):
                    new += [f"class({name}) attributes({attr}.{k}) wrong, [expected: {v}, real: {value.get(k)}]"
                            for k, v in want[attr].items() if not isinstance(value, dict) or k not in value
                            or value[k] != v]
                elif want[attr] != value:
                    new.append(f"class({name}) attributes({attr}) wrong, [expected: {want[attr]}, real: {value}]")
            last_valid = not new
            errors += new
        elif not last_valid:
            errors.append(errors[-1])
    return {"valid": not errors, "error_type": "class attributes wrong" if errors else "", "errors": errors}


def process_accuracy(executed: list[str], milestones: list) -> float:
    """Upstream's process accuracy of a failed episode: the share of milestones found in
    order among the executed agent messages (stripped equality), the best over alternative
    lists; 1.0 when there are no milestones."""
    def one(stones: list[str]) -> float:
        found, i = 0, 0
        for stone in stones:
            while i < len(executed):
                i += 1
                if executed[i - 1].strip() == stone.strip():
                    found += 1
                    break
        return 1.0 if not stones else round(found / len(stones), 3)
    if milestones and isinstance(milestones[0], list):
        return max(one(s) for s in milestones)
    return one(milestones)


def _call_text(turn: AssistantTurn) -> str:
    """The visible answer; when empty, native tool calls rendered as call text."""
    if turn.content.strip() or not turn.tool_calls:
        return turn.content
    calls = [f"{c.name}({', '.join(f'{k}={v!r}' for k, v in (c.arguments or {}).items())})" for c in turn.tool_calls]
    return "[" + ", ".join(calls) + "]"


class ACEBenchAgentEnvironment(Environment):
    """One agent episode (module docstring); ``user`` is needed for multi-turn tasks."""

    env_id = "acebench"

    def __init__(self, user: UserSimulator | None = None):
        """``user``: the simulated user of multi-turn tasks."""
        super().__init__()
        self.user = user

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """Build the scenario; multi-turn: the simulated user opens the conversation."""
        p = task.payload
        if p.get("category") not in AGENT_CATEGORIES:
            raise ValueError(f"ACEBenchAgentEnvironment got a {p.get('category')!r} task")
        self.task, self.done, self.stats = task, False, BenchStats()
        self.multi_turn = p["category"] == "agent_multi_turn"
        self.instances = build_instances(p["involved_classes"], p["initial_config"])
        self.index, self.executed, self.milestones = 0, False, []
        if not self.multi_turn:
            return ([{"role": "system", "content": prompts.AGENT_STEP_SYSTEM},
                     {"role": "user", "content": prompts.AGENT_STEP_USER.format(
                         functions=p["functions"], history=f"user:{p['question']}\n")}], [])
        if self.user is None:
            raise ValueError("agent_multi_turn needs a simulated user (ACEBenchTaskSource(user=...))")
        sim = prompts.USER_SIM_PHONE if "BaseApi" in p["involved_classes"] else prompts.USER_SIM_TRAVEL
        self.user_chat = [{"role": "system", "content": sim.format(instruction=p["question"])},
                          {"role": "user", "content": prompts.USER_SIM_OPENING}]
        opening = self._user_line()
        system = prompts.AGENT_TURN_SYSTEM + (prompts.TRAVEL_RULES if "Travel" in p["involved_classes"] else "") + (
            prompts.PHONE_RULES if "BaseApi" in p["involved_classes"] else "")
        return ([{"role": "system", "content": system},
                 {"role": "user", "content": prompts.AGENT_TURN_USER.format(
                     functions=p["functions"], history=f"user:{opening}\n")}], [])

    def _user_line(self) -> str:
        line = str(self.user(list(self.user_chat)))
        self.user_chat.append({"role": "assistant", "content": line})
        return line

    def _end(self) -> StepResult:
        self.done = True
        reward = self.finish()
        return StepResult([], True, reward, {"verdict": self.verdict, "stats": self.stats.as_dict()})

    def _observe(self, text: str) -> StepResult:
        self.index += 1
        if self.index >= MAX_MESSAGES:
            return self._end()
        return StepResult([{"role": "user", "content": text}], False, 0.0, {"stats": self.stats.as_dict()})

    def step(self, turn: AssistantTurn) -> StepResult:
        """One agent message: finish, run its calls, or (multi-turn) pass it to the user."""
        self._begin_step()
        text = _call_text(turn)
        i, self.index = self.index, self.index + 1
        if (i > 1 and FINISH in text) or self.index >= MAX_MESSAGES:
            return self._end()
        try:
            calls = parse_agent_calls(text)
            if self.multi_turn and not re.search(r"\[.*\]", text):
                raise AnswerFormatError("no bracketed call")
        except AnswerFormatError:
            calls = None
        if calls is None and self.multi_turn:  # to the simulated user
            self.user_chat.append({"role": "user", "content": re.sub(r"^(user:|agent:)", "", text)})
            line = self._user_line()
            if self.index > 1 and FINISH in line:
                self.index += 1
                return self._end()
            return self._observe(f"user:{line}")
        self.milestones.append(text)
        if calls is None:
            self.stats.parse_errors += 1
            return self._observe(f"execution result:{NOT_A_CALL}")
        results, failed = execute(self.instances, calls, stop_on_error=self.multi_turn)
        self.stats.tool_calls += len(calls)
        self.stats.tool_exceptions += int(failed)
        # upstream keeps the end state of multi-turn only from an execution without errors
        self.executed = self.executed or not (self.multi_turn and failed)
        return self._observe(("execution:" if self.multi_turn else "execution result:") + str(results))

    def finish(self) -> float:
        """Grade the end state (no execution at all: no end state, a failure)."""
        self.done = True
        p = self.task.payload
        state = end_state(self.instances) if self.executed else []
        self.verdict = check_end_state(state, p["ground_truth"])
        ok = self.verdict["valid"]
        process = 1.0 if ok else process_accuracy(self.milestones, p["mile_stone"])
        self.stats.extra.update({"end_state_passed": int(ok), "process_accuracy": process})
        return 1.0 if ok else 0.0
