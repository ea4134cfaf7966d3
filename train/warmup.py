"""Supervised warm-up of a random-init tiny model on oracle demonstrations.

A tiny model starts from random weights, so no rollout would succeed and the bank would
stay empty. The warm-up renders the synthetic family's oracle solutions
(:func:`lopd_jax.envs.synthetic.env.oracle_turns`) to token ids exactly as a rollout would
hold them -- prompt ids, each assistant turn's ids plus its end-of-turn id (mask 1), the
environment's real observation ids (mask 0) -- and trains the backbone with a token-mean
NLL on the assistant tokens (AdamW). Real checkpoints skip it (``stages.warmup_steps=0``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lopd_jax.chat.base import TokenTrajectory
from lopd_jax.envs.privileged import HintedTaskSource
from lopd_jax.envs.synthetic.env import ENV_ID, oracle_turns
from lopd_jax.method import losses
from lopd_jax.method.linear_nll import weighted_linear_nll
from lopd_jax.method.losses_kl import chunked_token_logp
from lopd_jax.core.types import Task
from train import mesh as mesh_lib
from train.bucketed_steps import BucketedBatch, _BucketedStep
from lopd_jax.rollout.episodes import Trajectory


def demonstration(ctx, task: Task, source=None) -> Trajectory:
    """The oracle trajectory of ``task`` as token ids and supervision mask (episodes of
    ``source``, default the run's task source; e.g. a :class:`lopd_jax.envs.privileged.HintedTaskSource`).

    Raises ValueError when the source has no oracle (only the synthetic family has one) or
    when the rendered demonstration does not earn reward 1 (a format / env mismatch).
    """

    if task.env_id != ENV_ID:
        raise ValueError(f"the warm-up needs oracle demonstrations, which only the synthetic source has "
                         f"(task {task.task_id!r} is {task.env_id!r}); set stages.warmup_steps=0.")
    fmt, env = ctx.fmt, (source or ctx.source).make_env()
    try:
        messages, tools = env.reset(task)
        prompt = fmt.prompt_ids(messages, tools)
        traj = TokenTrajectory()
        traj.add_context(prompt)
        msgs = list(messages)
        reward, turns = 0.0, []
        for turn in oracle_turns(task):
            ids = fmt.encode(turn.raw) + [fmt.end_of_turn_id]  # stands for generated ids: its tags are real
            traj.add_generated(ids)
            turns.append(len(ids))
            parsed = fmt.parse_generated(ids)  # what the env would see from these exact ids
            result = env.step(parsed)
            msgs.append(fmt.assistant_message(parsed))
            if result.done:
                reward = result.reward
                break
            msgs.extend(result.observation)
            traj.add_context(fmt.observation_ids(result.observation))
    finally:
        env.close()
    if reward < 1.0:
        raise ValueError(f"the oracle demonstration of {task.task_id!r} earns reward {reward}, not 1: the chat "
                         "format's rendering of tool calls does not round-trip through the environment.")
    n = len(traj.ids)
    return Trajectory(task=task, tokens=np.asarray(traj.ids, np.int32), mask=np.asarray(traj.mask, np.int32),
                      logprobs=np.zeros(n, np.float32), raw_logprobs=np.zeros(n, np.float32), messages=msgs,
                      tools=list(tools), reward=float(reward), env_stats={}, num_turns=len(turns),
                      turn_lengths=turns, insert_at=fmt.insertion_point(prompt), finish_reason="done")


def demonstrations(ctx, tasks: Sequence[Task], source=None) -> list[Trajectory]:
    """:func:`demonstration` of every task, in order."""
    return [demonstration(ctx, t, source) for t in tasks]


def warmup_tasks(ctx) -> list[Task]:
    """The warm-up's tasks: the source's own (``warmup_tasks()``, e.g. the synthetic source's
    separate warm-up tasks, whose hidden-rule parameters are random) or the training tasks."""
    own = getattr(ctx.source, "warmup_tasks", None)
    return list(own()) if callable(own) else list(ctx.train_tasks)


def warmup_pool(ctx) -> list[Trajectory]:
    """The warm-up's demonstrations: every warm-up task's (:func:`warmup_tasks`), plus, for a
    seeded ``stages.warmup_hint_fraction`` of them, a second copy whose prompt carries the
    task's oracle hint (:mod:`lopd_jax.envs.privileged`) -- so the model learns to read a
    privileged text context, as a pre-trained model can."""

    tasks = warmup_tasks(ctx)
    demos = demonstrations(ctx, tasks)
    n = round(ctx.cfg.stages.warmup_hint_fraction * len(tasks))
    if n:
        chosen = random.Random(f"warmup-hints:{ctx.cfg.seed}").sample(tasks, n)
        plain = {d.task.task_id: d for d in demos}
        weight = ctx.cfg.stages.warmup_hint_token_weight
        demos += [weigh_hint_tokens(plain[h.task.task_id], h, weight)
                  for h in demonstrations(ctx, chosen, HintedTaskSource(ctx.source))]
    return demos


def _prompt_ids(traj: Trajectory) -> np.ndarray:
    supervised = np.flatnonzero(traj.mask)
    return traj.tokens[:supervised[0] if supervised.size else len(traj.tokens)]


def weigh_hint_tokens(plain: Trajectory, hinted: Trajectory, weight: float) -> Trajectory:
    """``hinted`` with its supervision mask scaled by ``weight`` on the tokens only the hint
    supplies: supervised tokens whose id occurs in the hinted prompt but nowhere in the plain
    prompt of the same task (for ``dispatch.ship``, the hub's city token). The warm-up's loss
    is a weighted token mean, so this raises the share of the gradient that only reading the
    hint can reduce (``stages.warmup_hint_token_weight``; 1 leaves ``hinted`` unchanged)."""
    if weight == 1.0:
        return hinted
    added = np.setdiff1d(_prompt_ids(hinted), _prompt_ids(plain))
    scale = np.where(np.isin(hinted.tokens, added), np.float32(weight), np.float32(1.0))
    return dataclasses.replace(hinted, mask=hinted.mask.astype(np.float32) * scale)


def sft_loss(system, params, lora0, batch, totals: dict | None = None):
    """Token-mean NLL of the supervised (assistant) tokens under backbone ``params``, each
    token weighted by its ``loss_mask`` value (1, or :func:`weigh_hint_tokens`' weight).

    ``totals``: the whole batch's ``{"weight": sum of the positive token weights, "tokens":
    supervised tokens}`` when ``batch`` is one length-bucketed pass of it
    (:class:`train.bucketed_steps.BucketedSFTStep`): the loss and the ``nll`` metric are then
    this pass's exact shares of the batch's, so the passes sum to the padded step's values.
    None: the batch's own (the padded step).
    """
    model = system.backbone(params, jax.lax.stop_gradient(lora0))
    tokens, amask = batch["tokens"], batch["attention_mask"].astype(bool)
    hidden = model(tokens, attention_mask=amask, segment_ids=batch.get("segment_ids"), return_hidden=True)
    weight = batch["loss_mask"][:, 1:].astype(jnp.float32)
    head_args = (hidden[:, :-1], model.lm_head_kernel(), tokens[:, 1:])
    chunking = dict(chunk_size=system.step_cfg.loss.logits_chunk, compute_dtype=system.model_cfg.jnp_dtype)
    total_weight = None if totals is None else totals["weight"]
    if system.rules is None or system.rules.mesh.size == 1:
        # One device: the fused head + NLL (three head matmuls, no recomputed logits).
        loss, logp = weighted_linear_nll(*head_args, weight, total_weight=total_weight, **chunking)
    else:
        # Sharded: the head's gradient must be reduced across devices once, not per chunk.
        logp = chunked_token_logp(*head_args, **chunking)
        if totals is None:
            loss = losses.weighted_token_mean(-logp, weight)
        else:
            w = jnp.where(weight > 0, weight, 0.0)
            loss = jnp.sum(jnp.where(w > 0, -logp, 0.0) * w) / jnp.maximum(total_weight, 1e-9)
    # unweighted, the logged metric
    nll = losses.masked_token_mean(-logp, weight, None if totals is None else totals["tokens"])
    return loss, {"nll": nll, "tokens": jnp.sum(weight > 0, dtype=jnp.float32)}


def sft_update(opt, state, grads, metrics):
    """``(state, metrics)`` after one optimizer step of ``opt`` on ``grads`` (the padded and
    the length-bucketed warm-up end here); adds ``grad_norm`` to ``metrics``."""
    updates, new_opt = opt.update(grads, state["opt"], state["params"])
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
            "opt": new_opt}, metrics


def learning_rate(stages):
    """The warm-up's learning rate from a :class:`lopd_jax.settings.config.StagesSection`: the constant
    ``warmup_lr``, or with ``warmup_lr_schedule="cosine"`` a linear ramp from 0 over the first
    5% of ``warmup_steps`` to ``warmup_lr``, then a cosine decay to 10% of it at the end."""
    if stages.warmup_lr_schedule == "constant":
        return stages.warmup_lr
    ramp = max(1, round(0.05 * stages.warmup_steps))
    return optax.warmup_cosine_decay_schedule(0.0, stages.warmup_lr, ramp, max(stages.warmup_steps, ramp + 1),
                                              end_value=0.1 * stages.warmup_lr)


def make_sft_step(system, stages, clip: float = 1.0):
    """``(optimizer, step)``: a jitted ``(state, lora0, batch) -> (state, metrics)`` with
    ``state = {"step", "params", "opt"}`` (params sharded like theta0, state donated).
    ``stages``: the run's :class:`lopd_jax.settings.config.StagesSection`; its learning rate
    (:func:`learning_rate`) also fixes the optimizer state's structure, so the warm-up and
    every reader of its checkpoint build the same one here."""
    opt = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(learning_rate(stages), weight_decay=0.0))

    def step(state, lora0, batch):
        (loss, metrics), grads = jax.value_and_grad(lambda p: sft_loss(system, p, lora0, batch), has_aux=True)(
            state["params"])
        return sft_update(opt, state, grads, metrics)

    return opt, step


def sft_state_shardings(system, opt, example_state):
    """The warm-up state's shardings (``step`` replicated, ``params`` like theta0, the
    optimizer state like its parameters); None without a mesh."""
    if system.rules is None:
        return None
    psh = system.frozen_shardings()
    return {"step": system.rules.replicated(), "params": psh,
            "opt": mesh_lib.opt_state_shardings(opt, example_state["opt"], psh, system.rules)}


def jit_sft_step(system, opt, step, example_state, example_batch):
    """``(jitted step, state shardings)``: ``step`` with explicit in / out shardings on the
    system's mesh (state shardings None without a mesh)."""
    if system.rules is None:
        return jax.jit(step, donate_argnums=(0,)), None
    rep = system.rules.replicated()
    state_sh = sft_state_shardings(system, opt, example_state)
    lora_sh = system.composer_shardings()["lora"]
    batch_sh = system.batch_shardings(example_batch)
    return jax.jit(step, in_shardings=(state_sh, lora_sh, batch_sh), out_shardings=(state_sh, rep),
                   donate_argnums=(0,)), state_sh


class BucketedSFTStep(_BucketedStep):
    """The warm-up step (:func:`make_sft_step`) on a
    :class:`train.bucketed_steps.BucketedBatch`: ``(state, lora0, batch) -> (state,
    metrics)``. Each pass's loss is its share of the whole batch's weighted token mean
    (:func:`sft_loss` with the batch's ``totals``), so the summed gradients are the padded
    step's; then one :func:`sft_update`. ``opt``: the optimizer of :func:`make_sft_step`."""

    def __init__(self, system, example_state, opt):
        def pass_grads(state, lora0, mb, totals, i):
            (_, metrics), grads = jax.value_and_grad(lambda p: sft_loss(system, p, lora0, mb, totals),
                                                     has_aux=True)(state["params"])
            return (grads,), metrics

        def update(state, acc, extras):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc["grads"][0], state["params"])
            return sft_update(opt, state, grads, dict(acc["metrics"]))

        lora_sh = None if system.rules is None else system.composer_shardings()["lora"]
        super().__init__(system, example_state, pass_grads, update, (0,),
                         sft_state_shardings(system, opt, example_state), param_keys=("params",), frozen_sh=lora_sh)

    def _totals(self, batch: BucketedBatch) -> dict:
        return {"weight": jnp.float32(batch.stats["weight"]), "tokens": jnp.float32(batch.stats["supervised"])}
