"""``sdpo``: self-distillation from theta0 with a successful sibling rollout (same task,
same step) as text context; a row whose group has no other success is not distilled."""

from __future__ import annotations

from lopd_jax.method.text_context import trajectory_text
from train.arms.base import SUCCESS
from train.arms.text import TextArm
from train.bank_stage import to_experience


class SDPOArm(TextArm):
    """Each row's context is the first successful sibling after it in its group (cyclically)."""

    name = "sdpo"
    framing = ("A successful attempt at this task:", "End of the successful attempt. Now solve the task.")

    def contexts(self, step, trajs):
        """Per row: its sibling's trajectory as text, or None when no sibling succeeded."""
        G, texts = self.group_size, []
        for i in range(len(trajs)):
            g0 = i - i % G
            sibs = [j for j in range(g0, g0 + G) if j != i and trajs[j].reward >= SUCCESS]
            sibs.sort(key=lambda j: (j - i) % G)
            texts.append(trajectory_text(to_experience(trajs[sibs[0]]), self.ctx.cfg.bank.max_obs_chars)
                         if sibs else None)
        return texts


ARM = SDPOArm
