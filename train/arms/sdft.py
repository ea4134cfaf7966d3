"""``sdft``: self-distillation from an EMA of the student with a demonstration (another
training task of the row's family with its reference solution) as text context; the EMA
teacher (``ema <- decay * ema + (1 - decay) * student``, ``arms.ema_decay``) is checkpointed
with the state."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp

from train.arms.text import TextArm


def _copy(x):
    return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.copy(x)


class SDFTArm(TextArm):
    """Demonstrations drawn per (seed, step, row); the teacher is the EMA of the student."""

    name = "sdft"
    framing = ("Demonstration: a solved task of the same kind:", "End of demonstration. Now solve your own task.")

    def __init__(self, ctx, bank):
        super().__init__(ctx, bank)
        self.by_family: dict[str, list] = {}
        for t in ctx.train_tasks:
            self.by_family.setdefault(t.family, []).append(t)

    @classmethod
    def ema_decay(cls, cfg) -> float:
        """``arms.ema_decay``."""
        return cfg.arms.ema_decay

    @classmethod
    def add_state(cls, cfg, state):
        """The state with ``ema``, the EMA teacher: a copy of the student."""
        return {**state, "ema": jax.tree.map(_copy, state["student"])}

    def demonstration(self, task, step: int, row: int) -> str:
        """Another training task of ``task``'s family (drawn from (seed, step, row)) with its
        reference solution."""
        pool = [t for t in self.by_family.get(task.family, []) if t.task_id != task.task_id]
        if not pool:
            pool = [t for t in self.ctx.train_tasks if t.task_id != task.task_id] or [task]
        other = random.Random(f"{self.ctx.cfg.seed}/{step}/{row}").choice(pool)
        other = self.ctx.source.at_step([other], step)[0]
        return f"Task: {other.instruction}\nSolution:\n{self.hint(other)}"

    def contexts(self, step, trajs):
        """A demonstration per row."""
        return [self.demonstration(t.task, step, i) for i, t in enumerate(trajs)]


ARM = SDFTArm
