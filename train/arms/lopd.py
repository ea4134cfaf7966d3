"""``lopd``: LOPD (docs/method.md, "One LOPD step"): the teacher reads the composer's latents
of the experiences retrieved for each row's task; the student and the composer update.

Multi-host: each process builds the batch of its own rows (retrieval is per row); with
``lengths.buckets`` the rows are gathered and the whole batch runs in length-bucketed passes.
"""

from __future__ import annotations

from train.arms.base import Arm
from train.batches import gather_rows, lopd_batch
from train.bucketed_steps import BucketedLOPDStep
from train.steps import make_lopd_step


class LOPDArm(Arm):
    """LOPD's batch (:func:`train.batches.lopd_batch`) and step (:func:`train.steps.make_lopd_step`)."""

    name = "lopd"
    step_kind = "lopd"
    all_rows = False

    @classmethod
    def bucketed_step(cls, cfg, system, state):
        """:class:`train.bucketed_steps.BucketedLOPDStep`."""
        return BucketedLOPDStep(system, state)

    def batch(self, step: int, trajs):
        """The LOPD step batch of this process's rows; with ``lengths.buckets`` every host's
        rows, gathered, in length-bucketed passes (:meth:`train.run_context.RunContext.bucketed`)."""
        batch = lopd_batch(self.ctx, trajs, self.bank)
        if not self.ctx.cfg.lengths.enabled:
            return batch
        return self.ctx.bucketed(gather_rows(batch))

    def make_step(self, state, batch):
        """The jitted LOPD step, or its length-bucketed form."""
        if not isinstance(batch, dict):
            return self.bucketed_step(self.ctx.cfg, self.ctx.system, state)
        return make_lopd_step(self.ctx.system, state, batch)

    def record(self, step: int) -> dict:
        """What the teacher of step ``step`` depends on besides the samples' ``policy_version``:
        ``composer_version`` (the composer's updates before the step: 0 with
        ``steps.freeze_composer``, else ``step``) and ``bank_entries`` (the bank is frozen
        during the stage; its path is in every checkpoint's metadata)."""
        return {"composer_version": 0 if self.ctx.cfg.steps.freeze_composer else step,
                "bank_entries": len(self.bank)}


ARM = LOPDArm
