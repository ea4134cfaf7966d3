"""The shared base of the arms whose teacher reads a text context (:class:`TextArm`).

Each row's teacher is the student's tokens with a block of text tokens inserted at LOPD's
slot (:mod:`lopd_jax.method.text_context`); the step is top-M + tail reverse KL to that
teacher (:mod:`train.text_steps`). A text arm gives only what differs: its framing
sentences and each row's text (:meth:`TextArm.contexts`; None: the row is not distilled),
and, if it has one, an EMA teacher (:meth:`TextArm.ema_decay`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lopd_jax.method.text_context import context_block_ids, pack_blocks
from lopd_jax.rollout.episodes import training_arrays
from train.arms.base import Arm
from train.bucketed_steps import BucketedTextStep
from train.text_steps import make_text_distill_step, text_state_shardings


class TextArm(Arm):
    """A self-distillation arm with a text teacher context (see the module docstring)."""

    step_kind = "text"
    framing: tuple[str, str] = ("", "")  # (before, after) the text in the context block

    def __init__(self, ctx, bank):
        super().__init__(ctx, bank)
        self.width = ctx.cfg.arms.context_tokens
        self._hints: dict[tuple[str, int], str] = {}

    @classmethod
    def ema_decay(cls, cfg) -> float | None:
        """The decay of the arm's EMA teacher (None: the teacher is theta0)."""
        return None

    @classmethod
    def bucketed_step(cls, cfg, system, state):
        """:class:`train.bucketed_steps.BucketedTextStep`."""
        return BucketedTextStep(system, state, cls.ema_decay(cfg))

    def shardings(self, state):
        """The text-distillation state's shardings (:func:`train.text_steps.text_state_shardings`)."""
        return text_state_shardings(self.ctx.system, state)

    def hint(self, task) -> str:
        """The task's oracle hint (the task source's ``oracle_hint``), cached per task and
        drift of its hidden rule (a drifting source changes a task's solution)."""
        key = (task.task_id, task.payload.get("drift_index", 0))
        if key not in self._hints:
            self._hints[key] = self.ctx.source.oracle_hint(task)
        return self._hints[key]

    def contexts(self, step: int, trajs: Sequence) -> list[str | None]:
        """Per row of step ``step``: the text of its teacher's context (None: not distilled)."""
        raise NotImplementedError

    def batch(self, step: int, trajs):
        """The text-distillation batch of step ``step``'s trajectories, each row with its
        context block; with ``lengths.buckets`` a :class:`train.bucketed_steps.BucketedBatch`
        of it (built from every row, the same on every process)."""
        ctx = self.ctx
        pad = ctx.tokenizer.pad_token_id or 0
        texts = self.contexts(step, trajs)
        blocks = [None if x is None else context_block_ids(ctx.tokenizer, self.framing, x, self.width) for x in texts]
        ctx_ids, ctx_len = pack_blocks(blocks, self.width, pad)
        arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=pad)
        batch = {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"],
                 "insert_at": arr["insert_at"], "ctx_ids": ctx_ids, "ctx_len": ctx_len,
                 "row_weight": np.asarray([x is not None for x in texts], np.float32), "rewards": arr["rewards"],
                 "old_logp": arr["raw_logprobs"]}  # the sampler's log-probs, for steps.is_correction
        # with lengths.buckets: every row in length-bucketed passes (train.bucketed_steps)
        return ctx.bucketed(batch) if ctx.cfg.lengths.enabled else batch

    def make_step(self, state, batch):
        """The jitted text-distillation update (:func:`train.text_steps.make_text_distill_step`),
        or its length-bucketed form."""
        if not isinstance(batch, dict):
            return self.bucketed_step(self.ctx.cfg, self.ctx.system, state)
        return make_text_distill_step(self.ctx.system, state, batch, self.ema_decay(self.ctx.cfg))
