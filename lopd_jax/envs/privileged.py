"""A task source whose prompts carry each task's oracle hint as text (the privileged context).

OPSD's teacher is theta0 with a fixed text context (the task's oracle hint,
:meth:`lopd_jax.envs.base.TaskSource.oracle_hint`) where LOPD's latents go: the start of the first
user message. :class:`HintedTaskSource` wraps any task source so that the first user message reads
``{before}\\n{hint}\\n{after}\\n\\n{instruction}`` (framing from
:data:`lopd_jax.method.text_context.HINT_FRAMING`) and is otherwise unchanged. Rolling out on it
measures "Base + oracle text context" (:mod:`lopd_jax.premise`); its demonstrations teach a tiny
model to read such a context during the warm-up (``stages.warmup_hint_fraction``). The hint is
tokenized with the instruction here but on its own in OPSD's step, so the ids can differ at the
two seams. Details: ``docs/baselines.md``.
"""

from __future__ import annotations

from typing import Any

from lopd_jax.envs.base import Environment, TaskSource
from lopd_jax.method.text_context import HINT_FRAMING
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolSchema

FRAMING_BEFORE, FRAMING_AFTER = HINT_FRAMING


def hint_block(hint: str, before: str = FRAMING_BEFORE, after: str = FRAMING_AFTER) -> str:
    """The text put in front of the instruction: framing, hint, framing, blank line."""
    return f"{before}\n{hint}\n{after}\n\n"


def with_hint(messages: list[Message], hint: str, before: str = FRAMING_BEFORE,
              after: str = FRAMING_AFTER) -> list[Message]:
    """A copy of ``messages`` with :func:`hint_block` prepended to the first user message."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") == "user":
            m["content"] = hint_block(hint, before, after) + str(m.get("content") or "")
            return out
    raise ValueError("the episode's messages have no user message to carry the hint")


class HintedEnvironment(Environment):
    """The wrapped environment with the task's hint in the first user message."""

    def __init__(self, inner: Environment, hint_fn, before: str, after: str):
        """Wrap ``inner``; ``hint_fn(task) -> str`` gives each task's hint."""
        super().__init__()
        self.inner, self.hint_fn, self.before, self.after = inner, hint_fn, before, after
        self.env_id = inner.env_id

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """The wrapped reset, hint added."""
        messages, tools = self.inner.reset(task)
        self.task, self.done = task, False
        return with_hint(messages, self.hint_fn(task), self.before, self.after), tools

    def step(self, turn: AssistantTurn) -> StepResult:
        """The wrapped step (statistics mirrored)."""
        result = self.inner.step(turn)
        self.stats, self.done = self.inner.stats, self.inner.done
        return result

    def finish(self) -> float:
        """The wrapped finish."""
        return self.inner.finish()

    def close(self) -> None:
        """Close the wrapped environment."""
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # check_results() and the like
        return getattr(self.__dict__["inner"], name)


class HintedTaskSource(TaskSource):
    """``source`` with each task's :meth:`~TaskSource.oracle_hint` in its prompt (see the
    module docstring); tasks, splits and rewards are the wrapped source's."""

    def __init__(self, source: TaskSource, before: str = FRAMING_BEFORE, after: str = FRAMING_AFTER):
        """Wrap ``source`` (it must implement ``oracle_hint``)."""
        self.source, self.before, self.after = source, before, after
        self.env_id = source.env_id

    def tasks(self, split: str) -> list[Task]:
        """The wrapped source's tasks."""
        return self.source.tasks(split)

    def oracle_hint(self, task: Task) -> str:
        """The wrapped source's hint."""
        return self.source.oracle_hint(task)

    def cluster_key(self, task: Task) -> str:
        """The wrapped source's cluster key."""
        return self.source.cluster_key(task)

    def make_env(self) -> HintedEnvironment:
        """A wrapped environment whose prompts carry the hint."""
        return HintedEnvironment(self.source.make_env(), self.source.oracle_hint, self.before, self.after)
