"""``opsd``: self-distillation from theta0 with the task's oracle hint as text context
(docs/baselines.md: an oracle hint, an upper bound rather than a peer)."""

from __future__ import annotations

from lopd_jax.method.text_context import HINT_FRAMING
from train.arms.text import TextArm


class OPSDArm(TextArm):
    """Every row's context is its task's oracle hint."""

    name = "opsd"
    framing = HINT_FRAMING

    def contexts(self, step, trajs):
        """The oracle hint of every row's task."""
        return [self.hint(t.task) for t in trajs]


ARM = OPSDArm
