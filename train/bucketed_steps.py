"""Length-bucketed training steps: work that follows the trajectories' real lengths.

A padded step runs every row at the total-token cap. Here a step's rows are split into
*passes* (:func:`lopd_jax.planning.length_model.plan_passes`) of one bucket length each; one
jitted pass function per step kind (LOPD, GRPO, text distillation, composer cold start; the
warm-up in :class:`train.warmup.BucketedSFTStep`) accumulates a pass's gradients and metrics on
the devices, and one jitted update applies the optimizers to the sum: the global batch stays
one update. Every normalizer comes from the whole batch before the passes run, so the summed
gradients equal the padded step's up to fp32 summation order.

Multi-host: :class:`BucketedBatch` is built from the whole batch on every process (the plan
must be the same everywhere); :meth:`BucketedBatch.put` hands each process its rows.
Exactness argument and measurements: ``docs/length_buckets.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lopd_jax.method import losses
from lopd_jax.planning.length_model import Pass, plan_passes
from train.distributed import global_array, row_range
from train.steps import (cold_start_loss, cold_start_update, grad_shares, grpo_loss, grpo_update, lopd_grads,
                         lopd_loss, lopd_update)
from train.system import LOPDSystem
from train.text_steps import text_distill_loss, text_state_shardings, text_update

SEQ_KEYS = ("tokens", "attention_mask", "loss_mask", "old_logp")  # per-token [B, S] batch entries
_NOT_SUMMED = ("beta", "delta_per_rollout")


def row_lengths(batch: dict) -> np.ndarray:
    """Tokens each row of a (right-padded) batch needs: one past its last attended or
    supervised position."""
    live = np.asarray(batch["attention_mask"]).astype(bool) | (np.asarray(batch["loss_mask"]) != 0)
    S = live.shape[1]
    last = S - np.argmax(live[:, ::-1], axis=1)
    return np.where(live.any(axis=1), last, 0)


@dataclasses.dataclass
class BucketedBatch:
    """A step batch split into passes of one bucket length each.

    ``passes``: per pass a dict of the batch's entries for its rows (``SEQ_KEYS`` cut to the
    pass's length) plus ``row_valid`` (0 on padding rows) and ``row_index`` (the row in the
    batch, -1 on padding rows). ``plan``: the :class:`lopd_jax.planning.length_model.Pass` es.
    ``rows``: the batch's rows; ``stats``: whole-batch numbers the update needs
    (``mean_reward``, ``tokens`` attended, ``supervised`` N, ``rollouts`` R, ``rows``, the
    supervision ``weight``: sum of the positive ``loss_mask`` values, the warm-up's normalizer).
    Numpy on the host until :meth:`put`.
    """

    passes: list[dict]
    plan: list[Pass]
    rows: int
    stats: dict

    def put(self, system: LOPDSystem) -> "BucketedBatch":
        """The passes as global arrays on the system's batch shardings (each process puts
        its rows of every pass)."""
        out = []
        for p in self.passes:
            sh = system.batch_shardings(p)
            if sh is None:
                out.append({k: jnp.asarray(v) for k, v in p.items()})
                continue
            n = len(p["row_index"])
            lo, hi = row_range(sh["row_index"], n)
            out.append({k: global_array(np.asarray(v)[lo:hi], sh[k], n) for k, v in p.items()})
        return dataclasses.replace(self, passes=out)

    def padded_tokens(self) -> int:
        """Row tokens the passes process (padding rows included)."""
        return sum(p.seq * len(p.rows) for p in self.plan)


def bucketed_batch(batch: dict, buckets: Sequence[int], shard_tokens: int, shards: int,
                   fill: str = "longest_first") -> BucketedBatch:
    """Split a whole step batch (numpy, every row) into the passes of
    :func:`lopd_jax.planning.length_model.plan_passes`: rows grouped by bucket, ``shard_tokens``
    tokens per batch shard and pass, ``shards`` batch shards."""
    lengths = row_lengths(batch)
    B = len(lengths)
    plan = plan_passes(lengths, buckets, shard_tokens, shards, fill)
    passes = []
    for p in plan:
        idx = np.asarray(p.rows, np.int64)
        valid = idx >= 0
        take = np.where(valid, idx, idx[valid][0])  # padding rows copy the pass's first row
        mb = {}
        for k, v in batch.items():
            v = np.asarray(v)[take]
            if k in SEQ_KEYS:
                v = v[:, :p.seq]
            mb[k] = v
        mb["loss_mask"] = np.where(valid[:, None], mb["loss_mask"], 0).astype(mb["loss_mask"].dtype)
        mb["row_valid"] = valid.astype(np.float32)
        mb["row_index"] = idx.astype(np.int32)
        passes.append(mb)
    return BucketedBatch(passes, plan, B, batch_stats(batch))


def batch_stats(batch: dict) -> dict:
    """The whole-batch numbers a pass-accumulating step needs (:class:`BucketedBatch`'s
    ``stats``), from the whole step batch (numpy, every row)."""
    counts = (np.asarray(batch["loss_mask"])[:, 1:] != 0).sum(1)
    if "row_weight" in batch:  # text distillation: rows with weight 0 are not distilled (train.text_steps)
        counts = np.where(np.asarray(batch["row_weight"]) != 0, counts, 0)
    return {"mean_reward": float(np.mean(np.asarray(batch["rewards"], np.float32))) if "rewards" in batch else 0.0,
            "tokens": float(np.asarray(batch["attention_mask"]).astype(np.float32).sum()),
            "supervised": float(counts.sum()), "rollouts": float((counts > 0).sum()), "rows": len(counts),
            "weight": float(np.maximum(np.asarray(batch["loss_mask"], np.float32)[:, 1:], 0).sum())}


def _f32(t):
    return jax.tree.map(lambda x: x.astype(jnp.float32), t)


class _BucketedStep:
    """``(state, frozen, BucketedBatch) -> (state, metrics)``: the passes' jitted gradient
    accumulation (compiled once per bucket) then one jitted update."""

    def __init__(self, system: LOPDSystem, example_state, pass_grads: Callable, update: Callable, argnums,
                 state_sh, param_keys: tuple[str, ...] | None = None, frozen_sh=None):
        self.system, self.argnums = system, argnums
        # the second argument's shardings (default: the frozen backbone's; the warm-up passes LoRA there)
        self.frozen_sh = frozen_sh
        # the state entries trained (gradients in this order): by default the argnums of (student, composer)
        self.param_keys = param_keys or tuple(("student", "composer")[i] for i in argnums)
        self._pass_grads, self._update_fn = pass_grads, update
        self.state_sh = state_sh
        rules = system.rules
        self.grad_sh = None if state_sh is None else tuple(state_sh[k] for k in self.param_keys)
        self._zero_grads = jax.jit(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p),
                                   out_shardings=self.grad_sh)
        self._rep = None if rules is None else rules.replicated()
        self._pass_jit = None
        self._update_jit = None
        self._metric_shapes = None

    def _params(self, state):
        return tuple(state[k] for k in self.param_keys)

    def _accumulate(self, acc, state, frozen, mb, totals, i):
        grads, metrics = self._pass_grads(state, frozen, mb, totals, i)
        g = jax.tree.map(jnp.add, acc["grads"], _f32(grads))
        if self.grad_sh is not None:
            g = jax.lax.with_sharding_constraint(g, self.grad_sh)
        m = {}
        for k, v in acc["metrics"].items():
            if k == "delta_per_rollout":  # each row's value at its place in the batch
                idx = mb["row_index"].reshape(-1)  # [rows], or [P * K] segments of a packed pass
                idx = jnp.where(idx < 0, v.shape[0], idx)
                m[k] = v.at[idx].add(metrics[k], mode="drop")
            elif k == "beta":
                m[k] = metrics[k]
            elif k.endswith("_max"):
                m[k] = jnp.maximum(v, metrics[k])
            else:
                m[k] = v + metrics[k]
            m[k] = jax.lax.convert_element_type(m[k], v.dtype)  # strong types: no retrace on the next pass
        return {"grads": g, "metrics": m}

    def _setup(self, state, frozen, mb0, totals) -> None:
        """Build the jitted pass and update (shardings from the first pass) and learn the
        metrics' shapes (traced once, abstractly)."""
        system = self.system
        batch_sh = system.batch_shardings(mb0)
        if batch_sh is None:
            self._pass_jit = jax.jit(self._accumulate, donate_argnums=(0,))
            self._update_jit = jax.jit(self._update_fn, donate_argnums=(0,))
        else:
            acc_sh = {"grads": self.grad_sh, "metrics": self._rep}
            frozen_sh = system.frozen_shardings() if self.frozen_sh is None else self.frozen_sh
            self._pass_jit = jax.jit(self._accumulate, donate_argnums=(0,),
                                     in_shardings=(acc_sh, self.state_sh, frozen_sh, batch_sh, self._rep, self._rep),
                                     out_shardings=acc_sh)
            self._update_jit = jax.jit(self._update_fn, donate_argnums=(0,),
                                       in_shardings=(self.state_sh, acc_sh, self._rep),
                                       out_shardings=(self.state_sh, self._rep))
        shapes = jax.eval_shape(lambda s, f, mb, t: self._pass_grads(s, f, mb, t, 0)[1], state, frozen, mb0, totals)
        self._metric_shapes = {k: (v.shape, v.dtype) for k, v in shapes.items()}

    def _metric_shape(self, k: str, rows: int):
        shape, dtype = self._metric_shapes[k]
        return ((rows,) if k == "delta_per_rollout" else shape), dtype

    def lower(self, state, frozen, abstract_pass: dict, rows: int, totals: dict):
        """``(lowered pass, lowered update)`` for a pass of ``abstract_pass``'s shapes
        (``jax.ShapeDtypeStruct`` s, e.g. for an ahead-of-time compile) in a batch of
        ``rows`` rows; ``state`` / ``frozen`` may be abstract too."""
        if self._pass_jit is None:
            self._setup(state, frozen, abstract_pass, totals)
        sds = jax.ShapeDtypeStruct
        grads = jax.tree.map(lambda x: sds(x.shape, jnp.float32), self._params(state))
        metrics = {k: sds(*self._metric_shape(k, rows)) for k in self._metric_shapes}
        acc = {"grads": grads, "metrics": metrics}
        extras = {"mean_reward": sds((), jnp.float32), "tokens": sds((), jnp.float32)}
        return (self._pass_jit.lower(acc, state, frozen, abstract_pass, totals, sds((), jnp.int32)),
                self._update_jit.lower(state, acc, extras))

    def accumulate(self, state, frozen, batch: BucketedBatch) -> dict:
        """Run every pass: ``{"grads": summed fp32 gradients (tuple over the trained
        parameter groups), "metrics": summed metric shares}`` of the whole batch."""
        if self._pass_jit is None:
            self._setup(state, frozen, batch.passes[0], self._totals(batch))
        metrics0 = {k: jnp.zeros(*self._metric_shape(k, batch.rows)) for k in self._metric_shapes}
        if self._rep is not None:
            metrics0 = jax.device_put(metrics0, self._rep)
        acc = {"grads": self._zero_grads(self._params(state)), "metrics": metrics0}
        totals = self._totals(batch)
        for i, mb in enumerate(batch.passes):
            acc = self._pass_jit(acc, state, frozen, mb, totals, jnp.int32(i))
        return acc

    def __call__(self, state, frozen, batch: BucketedBatch):
        """One step: :meth:`accumulate`, then the jitted update of the whole batch."""
        acc = self.accumulate(state, frozen, batch)
        extras = {"mean_reward": jnp.float32(batch.stats["mean_reward"]), "tokens": jnp.float32(batch.stats["tokens"])}
        return self._update_jit(state, acc, extras)

    def _totals(self, batch: BucketedBatch) -> dict:
        raise NotImplementedError


class BucketedLOPDStep(_BucketedStep):
    """The LOPD step (:func:`train.steps.make_lopd_step`) on a :class:`BucketedBatch`.

    With the composer trained, each pass also accumulates the composer gradients of the
    margin and anchor terms (:func:`train.steps.lopd_grads`), so the update logs the
    whole batch's :func:`train.steps.grad_shares`, as the padded step does."""

    def __init__(self, system: LOPDSystem, example_state):
        cfg = system.step_cfg
        argnums = (0,) if cfg.freeze_composer else (0, 1)
        with_composer = len(argnums) == 2
        self.elements = system.composer_cfg.num_slots * system.model_cfg.hidden_size

        def pass_grads(state, frozen, mb, totals, i):
            _, sub = jax.random.split(state["rng"])
            fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, mb, jax.random.fold_in(sub, i),  # noqa: E731
                                          totals)
            metrics, grads, per_term = lopd_grads(fn, state["student"], state["composer"], with_composer)
            return (tuple(grads) + tuple(per_term)) if with_composer else tuple(grads), metrics

        def update(state, acc, extras):
            rng, _ = jax.random.split(state["rng"])
            params = (state["student"], state["composer"])
            grads = tuple(jax.tree.map(lambda g, p: g.astype(p.dtype), g, params[i])
                          for g, i in zip(acc["grads"], argnums))
            metrics = losses.add_margin_constant(acc["metrics"], cfg.loss.margin)
            if with_composer:  # acc["grads"]: student, composer, then the margin and anchor terms' composer grads
                metrics.update(grad_shares(acc["grads"][1], acc["grads"][2:]))
            return lopd_update(system, state, grads, metrics, rng, extras["mean_reward"], extras["tokens"])

        keys = ("student", "composer", "composer", "composer") if with_composer else ("student",)
        super().__init__(system, example_state, pass_grads, update, argnums, system.state_shardings(example_state),
                         param_keys=keys)

    def _totals(self, batch: BucketedBatch) -> dict:
        s = batch.stats
        return {"tokens": jnp.float32(s["supervised"]), "rollouts": jnp.float32(s["rollouts"]),
                "anchor_elements": jnp.float32(s["rows"] * self.elements)}


class BucketedGRPOStep(_BucketedStep):
    """The GRPO step (:func:`train.steps.make_grpo_step`) on a :class:`BucketedBatch`
    whose passes carry ``advantages`` (:func:`grpo_bucketed_batch`)."""

    def __init__(self, system: LOPDSystem, example_state, group_size: int = 4):
        def pass_grads(state, frozen, mb, totals, i):
            (_, metrics), grads = jax.value_and_grad(
                lambda sp: grpo_loss(system, sp, state, frozen, mb, group_size, totals["tokens"]),
                has_aux=True)(state["student"])
            metrics = dict(metrics)
            metrics["ratio_max_dev_max"] = metrics.pop("ratio_max_dev")
            return (grads,), metrics

        def update(state, acc, extras):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc["grads"][0], state["student"])
            metrics = dict(acc["metrics"])
            metrics["ratio_max_dev"] = metrics.pop("ratio_max_dev_max")
            return grpo_update(system, state, grads, metrics, extras["mean_reward"])

        super().__init__(system, example_state, pass_grads, update, (0,), system.state_shardings(example_state))

    def _totals(self, batch: BucketedBatch) -> dict:
        return {"tokens": jnp.float32(batch.stats["supervised"])}


class BucketedTextStep(_BucketedStep):
    """The text-distillation step of OPSD / SDPO / SDFT / Skill-SD
    (:func:`train.text_steps.make_text_distill_step`) on a :class:`BucketedBatch`: the
    global token mean over the distilled tokens (supervised tokens of rows with
    ``row_weight`` != 0) of the whole batch; ``ema_decay``: SDFT's EMA teacher, updated once
    after the step. The context block (``ctx_ids``) is whole in every pass; only the
    student rows are cut to their bucket."""

    def __init__(self, system: LOPDSystem, example_state, ema_decay: float | None = None):
        use_ema = ema_decay is not None

        def pass_grads(state, frozen, mb, totals, i):
            (_, metrics), grads = jax.value_and_grad(
                lambda sp: text_distill_loss(system, sp, state, frozen, mb, use_ema, totals["tokens"],
                                             totals["rollouts"]),
                has_aux=True)(state["student"])
            return (grads,), metrics

        def update(state, acc, extras):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc["grads"][0], state["student"])
            return text_update(system, state, grads, dict(acc["metrics"]), ema_decay, extras["mean_reward"],
                               extras["tokens"])

        super().__init__(system, example_state, pass_grads, update, (0,), text_state_shardings(system, example_state))

    def _totals(self, batch: BucketedBatch) -> dict:
        return {"tokens": jnp.float32(batch.stats["supervised"]), "rollouts": jnp.float32(batch.stats["rollouts"])}


class BucketedColdStartStep(_BucketedStep):
    """The composer cold start (:func:`train.steps.make_cold_start_step`) on a
    :class:`BucketedBatch`: the token-mean NLL over the whole batch's supervised tokens,
    then one step of each clip group's optimizer. LoRA dropout (default 0) draws per
    pass, as in the LOPD step's micro-batches."""

    def __init__(self, system: LOPDSystem, example_state):
        def pass_grads(state, frozen, mb, totals, i):
            _, sub = jax.random.split(state["rng"])
            (_, metrics), grads = jax.value_and_grad(
                lambda cp: cold_start_loss(system, cp, frozen, mb, jax.random.fold_in(sub, i), totals["tokens"]),
                has_aux=True)(state["composer"])
            return (grads,), metrics

        def update(state, acc, extras):
            rng, _ = jax.random.split(state["rng"])
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc["grads"][0], state["composer"])
            return cold_start_update(system, state, grads, dict(acc["metrics"]), rng)

        super().__init__(system, example_state, pass_grads, update, (1,), system.cold_start_shardings(example_state),
                         param_keys=("composer",))

    def _totals(self, batch: BucketedBatch) -> dict:
        return {"tokens": jnp.float32(batch.stats["supervised"])}


def grpo_bucketed_batch(batch: dict, group_size: int, buckets, shard_tokens: int, shards: int,
                        fill: str = "longest_first") -> BucketedBatch:
    """:func:`bucketed_batch` of a GRPO batch, with each row's group advantage computed
    over the whole batch first (a group's rollouts may land in different passes)."""
    return bucketed_batch(with_group_advantages(batch, group_size), buckets, shard_tokens, shards, fill)


def with_group_advantages(batch: dict, group_size: int) -> dict:
    """A GRPO batch plus ``advantages`` [B]: each row's group advantage over the whole batch
    (before its rows are split into passes, where a group's rollouts may part)."""
    adv = np.asarray(losses.group_advantages(jnp.asarray(batch["rewards"], jnp.float32), group_size=group_size))
    return {**batch, "advantages": adv.astype(np.float32)}


__all__ = ["SEQ_KEYS", "row_lengths", "BucketedBatch", "bucketed_batch", "batch_stats", "with_group_advantages", "grpo_bucketed_batch",
           "BucketedLOPDStep", "BucketedGRPOStep", "BucketedTextStep", "BucketedColdStartStep"]
