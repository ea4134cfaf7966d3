"""``grpo``: GRPO (docs/method.md, "Baselines in brief"): G rollouts per task,
group-normalized advantages, PPO-clip against the sampler's temperature-1 log-probs,
``arms.grpo_epochs`` updates per batch. No teacher."""

from __future__ import annotations

import numpy as np

from lopd_jax.rollout.episodes import training_arrays
from lopd_jax.settings.arm_config import group_size
from train.arms.base import Arm
from train.bucketed_steps import BucketedGRPOStep
from train.steps import make_grpo_step


class GRPOArm(Arm):
    """GRPO on the run's rollouts (see the module docstring)."""

    name = "grpo"
    step_kind = "grpo"

    def __init__(self, ctx, bank):
        super().__init__(ctx, bank)
        self.epochs = ctx.cfg.arms.grpo_epochs

    @classmethod
    def bucketed_step(cls, cfg, system, state):
        """:class:`train.bucketed_steps.BucketedGRPOStep` over groups of the arm's G."""
        return BucketedGRPOStep(system, state, group_size(cfg))

    def batch(self, step: int, trajs) -> dict[str, np.ndarray]:
        """The GRPO batch of step ``step``'s trajectories: tokens, masks, sampler log-probs, rewards."""
        ctx = self.ctx
        arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=ctx.tokenizer.pad_token_id or 0)
        batch = {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"],
                 "old_logp": arr["raw_logprobs"], "rewards": arr["rewards"]}
        # with lengths.buckets: every row in length-bucketed passes (train.bucketed_steps)
        return ctx.bucketed(batch, self.group_size) if ctx.cfg.lengths.enabled else batch

    def make_step(self, state, batch):
        """The jitted GRPO update, repeated ``arms.grpo_epochs`` times per batch (epoch 1's
        metrics); length-bucketed when the batch is."""
        if isinstance(batch, dict):
            step = make_grpo_step(self.ctx.system, state, batch, group_size=self.group_size)
        else:
            step = self.bucketed_step(self.ctx.cfg, self.ctx.system, state)

        def run(st, frozen, b):
            first = None
            for _ in range(self.epochs):  # epoch 1's metrics: its ratio is exactly pi / pi_sampler
                st, m = step(st, frozen, b)
                first = m if first is None else first
            return st, first
        return run


ARM = GRPOArm
