"""ACEBench (English): the normal and special categories, read from upstream's data files
and graded as upstream's checker grades them.

An episode is one assistant turn answering with calls as text (``[ApiName(key='v')]``;
upstream's prompts, :mod:`lopd_jax.envs.acebench.prompts`); its visible answer, or its
native tool calls when the answer is empty, is graded by :mod:`lopd_jax.envs.acebench.checker`
(never ``eval``): reward 1.0 when correct, the verdict in ``StepResult.info["verdict"]``.
:func:`aggregate` scores a multi-turn conversation 1 only when all its rows pass. The agent
categories live in :mod:`lopd_jax.envs.acebench.agent`; :class:`ACEBenchTaskSource` loads
them beside these. Data layout and grading rules, with every deviation from upstream:
docs/evaluation.md, "ACEBench".
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from lopd_jax.envs.acebench import prompts
from lopd_jax.envs.acebench.agent import (AGENT_CATEGORIES, ACEBenchAgentEnvironment, UserSimulator,
                                          load_agent_category, need_field, read_rows)
from lopd_jax.envs.acebench.checker import (MAX_ANSWER_CHARS, AnswerFormatError,
                                            check_call, check_normal, decode_calls, grade,
                                            grade_special, normalize)
from lopd_jax.envs.base import Environment, HeldoutTaskSource
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolSchema

__all__ = ["ENV_ID", "NORMAL_CATEGORIES", "SPECIAL_CATEGORIES", "AGENT_CATEGORIES", "UPSTREAM",
           "MAX_ANSWER_CHARS", "AnswerFormatError", "check_call", "check_normal", "decode_calls",
           "grade", "grade_special", "normalize", "load_category", "conversation_of",
           "aggregate", "aggregate_counts", "ACEBenchEnvironment", "ACEBenchTaskSource", "load_agent_category",
           "UserSimulator"]

ENV_ID = "acebench"
NORMAL_CATEGORIES = (
    "normal_single_turn_single_function", "normal_single_turn_parallel_function",
    "normal_multi_turn_user_adjust", "normal_multi_turn_user_switch", "normal_similar_api",
    "normal_preference", "normal_atom_bool", "normal_atom_enum", "normal_atom_number",
    "normal_atom_list", "normal_atom_object_deep", "normal_atom_object_short")
SPECIAL_CATEGORIES = ("special_incomplete", "special_error_param", "special_irrelevant")
UPSTREAM = "https://github.com/ACEBench/ACEBench/tree/main/data_all/data_en"


# ---------------------------------------------------------------------------------------
# Data files.

def _check_functions(functions: list, where: str) -> None:
    for i, fn in enumerate(functions):
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: field 'function'[{i}] needs a string 'name'")
        if not isinstance(fn.get("parameters", fn.get("arguments")), dict):
            raise ValueError(f"{where}: field 'function'[{i}] ({fn['name']}) needs a "
                             f"'parameters' object")


def _check_truth(truth: Any, category: str, where: str) -> None:
    field = "ground_truth"
    if category == "special_irrelevant":
        if not isinstance(truth, str):
            raise ValueError(f"{where}: field {field!r} must be a string for {category}")
        return
    if category in ("special_incomplete", "special_error_param"):
        if not isinstance(truth, dict) or not all(
                isinstance(v, list) and all(isinstance(x, str) for x in v) for v in truth.values()):
            raise ValueError(f"{where}: field {field!r} must map names to lists of strings")
        return
    options = truth if isinstance(truth, list) else [truth]
    if not options or not all(isinstance(o, dict) and all(isinstance(v, dict) for v in o.values())
                              for o in options):
        raise ValueError(f"{where}: field {field!r} must be {{api: {{param: value}}}} "
                         f"or a non-empty list of those")


def load_category(data_dir: str, category: str) -> list[Task]:
    """The tasks of one ACEBench category from ``data_dir`` (upstream's ``data_en`` folder:
    ``data_<category>.json`` and ``possible_answer/data_<category>.json``).

    FileNotFoundError names a missing file and where upstream publishes it; ValueError
    names ``file:line`` and the field of a malformed row, before anything runs.
    """
    if category not in NORMAL_CATEGORIES + SPECIAL_CATEGORIES:
        raise ValueError(f"unknown ACEBench category {category!r}; known: "
                         f"{list(NORMAL_CATEGORIES + SPECIAL_CATEGORIES)}")
    qpath = os.path.join(data_dir, f"data_{category}.json")
    apath = os.path.join(data_dir, "possible_answer", f"data_{category}.json")
    questions, answers = read_rows(qpath), read_rows(apath)
    truth_by_id: dict[str, Any] = {}
    for where, row in answers:
        rid = need_field(row, "id", str, where)
        if "ground_truth" not in row:
            raise ValueError(f"{where}: missing field 'ground_truth'")
        _check_truth(row["ground_truth"], category, where)
        truth_by_id[rid] = row["ground_truth"]
    context_field = "profile" if category == "normal_preference" else "time"
    tasks = []
    for where, row in questions:
        rid = need_field(row, "id", str, where)
        question = need_field(row, "question", str, where)
        functions = need_field(row, "function", list, where)
        _check_functions(functions, where)
        context = need_field(row, context_field, str, where)
        if rid not in truth_by_id:
            raise ValueError(f"{where}: id {rid!r} has no 'ground_truth' row in {apath}")
        template = (prompts.SPECIAL_SYSTEM if category.startswith("special")
                    else prompts.PREFERENCE_SYSTEM if category == "normal_preference"
                    else prompts.NORMAL_SYSTEM)
        system = template.format(**{context_field: context, "function": functions})
        tasks.append(Task(task_id=rid, env_id=ENV_ID, instruction=question, family=category,
                          payload={"category": category, "system": system,
                                   "user": prompts.USER.format(question=question),
                                   "functions": functions, "ground_truth": truth_by_id[rid]}))
    return tasks


def conversation_of(task_id: str) -> str:
    """``normal_multi_turn_user_adjust_3_1`` -> ``normal_multi_turn_user_adjust_3``."""
    return task_id.rsplit("_", 1)[0]


def aggregate(per_task: list[dict[str, Any]]) -> dict[str, float]:
    """Per-category accuracy (0-100) from ``{"task_id", "category", "passed": [bool] * n}``
    (pass@1 estimate = mean over samples); the multi-turn categories count a conversation
    as passed only when every row of it passes (upstream's end-to-end accuracy), and
    ``normal`` / ``special`` / ``normal_special`` are the unweighted category means, and
    ``agent`` the mean of the two agent categories (the paper's ACEBench cell)."""
    cats: dict[str, dict[str, list[float]]] = {}
    for t in per_task:
        rate = sum(t["passed"]) / len(t["passed"])
        group = conversation_of(t["task_id"]) if t["category"].startswith("normal_multi_turn") else t["task_id"]
        cats.setdefault(t["category"], {}).setdefault(group, []).append(rate)
    out = {c: round(100.0 * sum(min(v) for v in groups.values()) / len(groups), 2)
           for c, groups in sorted(cats.items())}
    for name, prefix in (("normal", "normal_"), ("special", "special_")):
        xs = [v for c, v in out.items() if c.startswith(prefix)]
        if xs:
            out[name] = round(sum(xs) / len(xs), 2)
    if "normal" in out and "special" in out:
        out["normal_special"] = round((out["normal"] + out["special"]) / 2, 2)
    if all(c in out for c in AGENT_CATEGORIES):  # the paper's ACEBench cell
        out["agent"] = round(sum(out[c] for c in AGENT_CATEGORIES) / len(AGENT_CATEGORIES), 2)
    return out


def aggregate_counts(per_task: list[dict[str, Any]]) -> dict[str, int]:
    """The number of graded units behind each :func:`aggregate` entry: rows, or
    conversations for the multi-turn categories; the summaries sum their categories."""
    units: dict[str, set] = {}
    for t in per_task:
        group = conversation_of(t["task_id"]) if t["category"].startswith("normal_multi_turn") else t["task_id"]
        units.setdefault(t["category"], set()).add(group)
    out = {c: len(g) for c, g in sorted(units.items())}
    for name, prefix in (("normal", "normal_"), ("special", "special_")):
        if any(c.startswith(prefix) for c in units):
            out[name] = sum(v for c, v in out.items() if c.startswith(prefix))
    if "normal" in out and "special" in out:
        out["normal_special"] = out["normal"] + out["special"]
    if all(c in out for c in AGENT_CATEGORIES):
        out["agent"] = sum(out[c] for c in AGENT_CATEGORIES)
    return out


class ACEBenchEnvironment(Environment):
    """One ACEBench normal / special episode: one answer, graded (module docstring); an
    agent task's episode is run by an :class:`ACEBenchAgentEnvironment`."""

    env_id = ENV_ID

    def __init__(self, strict_scalars: bool = False, user: UserSimulator | None = None):
        """``strict_scalars``: also compare top-level number / boolean values (upstream
        only checks their type); ``user``: the simulated user of ``agent_multi_turn``."""
        super().__init__()
        self.strict_scalars, self.user, self.agent = strict_scalars, user, None

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """The task's system and user prompts; no tools (the answer is call text)."""
        if task.env_id != ENV_ID:
            raise ValueError(f"ACEBenchEnvironment got a {task.env_id!r} task")
        if task.payload["category"] in AGENT_CATEGORIES:
            self.agent = ACEBenchAgentEnvironment(self.user)
            opening = self.agent.reset(task)
            self.task, self.done, self.stats = task, False, self.agent.stats
            return opening
        self.agent = None
        self.task, self.done = task, False
        self.stats = type(self.stats)()
        return ([{"role": "system", "content": task.payload["system"]},
                 {"role": "user", "content": task.payload["user"]}], [])

    def step(self, turn: AssistantTurn) -> StepResult:
        """Grade the answer; the episode ends."""
        if self.agent is not None:
            result = self.agent.step(turn)
            self.done = self.agent.done
            return result
        self._begin_step()
        try:
            verdict = grade(self.task, turn, self.strict_scalars)
        except Exception as e:  # a grader bug must not crash the rollout: a failed answer
            verdict = {"valid": False, "error_type": "grader_error", "error": f"{type(e).__name__}: {e}"}
        self.done = True
        return StepResult([], True, 1.0 if verdict["valid"] else 0.0,
                          {"verdict": verdict, "stats": self.stats.as_dict()})

    def finish(self) -> float:
        """No answer was given: 0 (an agent episode: its end state is graded)."""
        self.done = True
        return self.agent.finish() if self.agent is not None else 0.0


class ACEBenchTaskSource(HeldoutTaskSource):
    """ACEBench's categories from ``data_dir`` (``data_en``); all are held out. ``limit``
    keeps the first N rows of each category, or the first N whole conversations of a
    normal multi-turn category (smoke runs). ``user`` simulates the user of
    ``agent_multi_turn`` (needed when that category is loaded)."""

    env_id = ENV_ID

    def __init__(self, data_dir: str, categories: Sequence[str] = NORMAL_CATEGORIES + SPECIAL_CATEGORIES,
                 limit: int | None = None, strict_scalars: bool = False, user: UserSimulator | None = None):
        """Load every category now (errors before anything runs)."""
        if "agent_multi_turn" in categories and user is None:
            raise ValueError("agent_multi_turn needs a simulated user: pass ACEBenchTaskSource(user=...)")
        self.strict_scalars, self.user = strict_scalars, user
        self._all = []
        for c in categories:
            if c in AGENT_CATEGORIES:
                self._all += load_agent_category(data_dir, c)[:limit]
                continue
            tasks = load_category(data_dir, c)
            if limit is not None and "multi_turn" in c:
                kept = list(dict.fromkeys(conversation_of(t.task_id) for t in tasks))[:limit]
                tasks = [t for t in tasks if conversation_of(t.task_id) in kept]
            self._all += tasks if limit is None or "multi_turn" in c else tasks[:limit]


    def make_env(self) -> Environment:
        """A fresh :class:`ACEBenchEnvironment`."""
        return ACEBenchEnvironment(self.strict_scalars, self.user)

    def oracle_hint(self, task: Task) -> str:
        """The possible answer(s) (agent tasks: the milestones), as JSON."""
        key = "mile_stone" if task.payload["category"] in AGENT_CATEGORIES else "ground_truth"
        return json.dumps(task.payload[key], ensure_ascii=False)
