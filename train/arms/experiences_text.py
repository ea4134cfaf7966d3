"""``experiences_text``: self-distillation from theta0 with LOPD's information given as text.

The teacher reads, as text at LOPD's slot, the same experiences LOPD's composer compresses
into latents: the ``composer.n_ret`` experiences the frozen bank retrieves for the row's
task (``ExperienceBank.retrieve``, as :func:`train.batches.retrieved_experience_arrays`
does for LOPD), each written as the composer's encoder reads it
(:func:`lopd_jax.method.text_context.trajectory_text`, observations cut to
``bank.max_obs_chars``), numbered, in retrieval order. The block is cut to
``arms.context_tokens`` like every text arm's. A row whose task retrieves nothing is not
distilled. The paper's Skill-SD kind of baseline: LOPD's retrieval without its composer.
"""

from __future__ import annotations

from lopd_jax.method.text_context import trajectory_text
from train.arms.text import TextArm


def experiences_block(experiences, max_obs_chars: int | None) -> str | None:
    """The text of retrieved ``experiences``: ``Example i:`` then the trajectory, one after
    another (None when there are none)."""
    parts = [f"Example {i}:\n{trajectory_text(e, max_obs_chars)}" for i, e in enumerate(experiences, 1)]
    return "\n\n".join(parts) or None


class ExperiencesTextArm(TextArm):
    """Each row's context is its task's retrieved experiences as text (see the module docstring)."""

    name = "experiences_text"
    framing = ("Reference examples: already solved tasks, given as text:",
               "End of reference examples. Now solve your own task from scratch.")

    def contexts(self, step, trajs):
        """Per row: the ``composer.n_ret`` experiences retrieved for its task, as text."""
        cfg = self.ctx.cfg
        tasks = [t.task for t in trajs]
        retrieved = self.bank.retrieve([t.instruction for t in tasks], [t.task_id for t in tasks])
        return [experiences_block(exps[:cfg.composer.n_ret], cfg.bank.max_obs_chars) for exps in retrieved]


ARM = ExperiencesTextArm
