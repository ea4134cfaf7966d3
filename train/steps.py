"""The jitted train steps: LOPD, composer cold start and GRPO (docs/method.md).

Each ``make_*_step(system)`` returns one ``jax.jit`` function with explicit in / out
shardings on the system's mesh (when it has one) and the state donated. Batch arrays are
batch-major; token-level arrays are [B, S] with ``loss_mask`` the supervision mask omega
on tokens (1 on generated assistant tokens). The loss at position j predicts token j + 1,
so the steps use ``loss_mask[:, 1:]`` as the per-prediction mask.

LOPD batch keys: tokens, attention_mask, loss_mask, insert_at [B], exp_tokens /
exp_mask [B, n_ret, L_e], rewards [B], old_logp [B, S] (the sampler's temperature-1 log-prob
of token t; read only with ``steps.is_correction``, docs/method.md).
Cold start: the same minus rewards and old_logp (trajectories are successful ones).
GRPO: tokens, attention_mask, loss_mask, old_logp [B, S] (sampler log-prob of token t,
aligned with tokens), rewards [B] with the G rollouts of a task adjacent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lopd_jax.method import losses
from lopd_jax.method.composer import slot_mask
from lopd_jax.method.losses_kl import chunked_token_logp, scans_unrolled
from lopd_jax.method.packing import is_packed, packed_teacher_hidden, segment_rows, unpack
from lopd_jax.method.splice import teacher_hidden_states
from train.nonfinite import all_finite, keep_if_finite
from train.system import LOPDSystem

sg = jax.lax.stop_gradient


def per_trajectory(batch):
    """``(view, rows)``: functions giving a batch's next-token arrays ``[B, S - 1]`` and
    per-trajectory arrays ``[B, ...]`` one row per trajectory -- the identity on a padded
    batch; on a packed pass (:mod:`lopd_jax.method.packing`) the unpacked ``[P * K, L]``
    view and the ``[P * K, ...]`` segment rows."""
    if not is_packed(batch):
        return (lambda x: x), (lambda x: x)
    return (lambda x: unpack(x, batch["unpack_index"])), segment_rows


def _jit(fn, system: LOPDSystem, state_sh, frozen_sh, batch_sh, donate=(0,)):
    if system.rules is None:
        return jax.jit(fn, donate_argnums=donate)
    rep = system.rules.replicated()
    return jax.jit(fn, in_shardings=(state_sh, frozen_sh, batch_sh), out_shardings=(state_sh, rep),
                   donate_argnums=donate)


def _apply(opt, grads, opt_state, params):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def lopd_loss(system: LOPDSystem, student_p, composer_p, state, frozen, batch, rng, totals=None):
    """The fused LOPD objective of one batch: (loss, metrics). See train.steps docstring.

    ``totals``: the whole batch's :func:`lopd_jax.method.losses.lopd_totals` when ``batch`` is a
    micro-batch of it (loss and metrics are then that micro-batch's share). With
    ``steps.is_correction`` the batch's ``old_logp`` weights the KL (see
    :func:`lopd_jax.method.losses.lopd_loss_from_stats`). A ``row_valid`` [B] entry (length-bucketed passes, :mod:`train.bucketed_steps`) takes
    the padding rows (0) out of the anchor; they carry no supervised token either.
    """
    frozen = sg(frozen)
    packed = is_packed(batch)
    _, rows = per_trajectory(batch)
    exp_tokens, exp_mask = rows(batch["exp_tokens"]), rows(batch["exp_mask"])
    latents = system.latents(frozen, composer_p, exp_tokens, exp_mask, rng)
    latents0 = sg(system.latents(frozen, sg(state["composer0"]), exp_tokens, exp_mask))
    teacher = system.backbone(frozen, sg(composer_p["lora"]))
    tokens, amask = batch["tokens"], batch["attention_mask"].astype(bool)
    n_lat = system.composer_cfg.num_latents

    def teacher_hidden(lat, slots):
        if packed:
            return packed_teacher_hidden(teacher, batch, lat, slots)
        return teacher_hidden_states(teacher, tokens, amask, batch["insert_at"], lat, system.layout, slots)

    t_hidden = teacher_hidden(latents, slot_mask(exp_mask, n_lat))
    student, use_lora = system.student(student_p, frozen, composer_p["lora"])
    s_hidden = student(tokens, attention_mask=amask, segment_ids=batch.get("segment_ids"), lora=use_lora,
                       return_hidden=True)
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    adv = losses.advantages_from_rewards(rows(batch["rewards"]).astype(jnp.float32))
    if "row_valid" in batch:  # padding rows (segments) of a bucketed (packed) pass: no anchor term
        w = rows(batch["row_valid"]).astype(latents.dtype)[:, None, None]
        latents, latents0 = latents * w, latents0 * w
    loss_cfg, dtype = system.step_cfg.loss, system.model_cfg.jnp_dtype
    # the teacher without latents (its slots masked, same prompt): the reference of delta_vs_plain_teacher
    plain = sg(teacher_hidden(sg(latents), slot_mask(jnp.zeros_like(exp_mask), n_lat)))
    plain_logp = chunked_token_logp(plain[:, :-1], sg(teacher.lm_head_kernel()), tokens[:, 1:],
                                    chunk_size=loss_cfg.logits_chunk, compute_dtype=dtype,
                                    logits_dtype=loss_cfg.logits_jnp_dtype(dtype))
    old_logp = batch["old_logp"][:, 1:] if loss_cfg.is_correction != "none" and "old_logp" in batch else None
    return losses.lopd_objective(
        s_hidden[:, :-1], student.lm_head_kernel(), t_hidden[:, :-1], sg(teacher.lm_head_kernel()),
        tokens[:, 1:], mask, adv, state["beta"], latents, latents0,
        loss=loss_cfg, compute_dtype=dtype, totals=totals, reference_logp=plain_logp,
        unpack_index=batch.get("unpack_index"), old_logp=old_logp)


TERMS = ("distill", "margin", "anchor")  # lopd_loss's loss_terms, in order


def lopd_grads(fn, sp, cp, with_composer: bool, per_term: bool = True):
    """``fn(sp, cp) -> (loss, metrics)`` (:func:`lopd_loss`): ``(metrics, (student grads,
    composer grads), composer grads of the margin and anchor terms)`` from one forward
    (``jax.vjp``): the full gradient is the pullback of ones over ``loss_terms``, each
    term's the pullback of its basis vector (the distillation term's is the remainder).
    Without the composer: ``(metrics, (student grads,), None)``; without ``per_term``:
    ``(metrics, grads, None)`` (the one pullback)."""
    def terms(sp, cp):
        _, metrics = fn(sp, cp)
        return metrics["loss_terms"], metrics

    if not with_composer:
        _, pull, metrics = jax.vjp(lambda p: terms(p, cp), sp, has_aux=True)
        return metrics, pull(jnp.ones(len(TERMS), jnp.float32)), None
    _, pull, metrics = jax.vjp(terms, sp, cp, has_aux=True)
    grads = pull(jnp.ones(len(TERMS), jnp.float32))
    if not per_term:
        return metrics, grads, None
    per_term = tuple(pull(jnp.eye(len(TERMS), dtype=jnp.float32)[k])[1] for k in (1, 2))
    return metrics, grads, per_term


def grad_shares(composer_grads, per_term) -> dict:
    """Each term's share of the composer's gradient: the global norm of its gradient over
    the sum of the three norms (``composer_grad_share_{distill,margin,anchor}``, summing to 1)."""
    margin, anchor = per_term
    distill = jax.tree.map(lambda g, m, a: g - m - a, composer_grads, margin, anchor)
    norms = jnp.stack([optax.global_norm(g) for g in (distill, margin, anchor)])
    shares = norms / jnp.maximum(jnp.sum(norms), 1e-30)
    return {f"composer_grad_share_{t}": shares[i] for i, t in enumerate(TERMS)}


def num_micro_steps(system: LOPDSystem, batch_size: int) -> int:
    """Micro-batches per LOPD step for a global batch of ``batch_size`` trajectories."""
    shards, micro = system.batch_shards(batch_size), system.step_cfg.micro_batch
    if batch_size % shards:
        raise ValueError(f"batch of {batch_size} does not split over {shards} batch shards.")
    local = batch_size // shards
    if micro == 0 or micro >= local:
        return 1
    if local % micro:
        raise ValueError(f"steps.micro_batch={micro} must divide the {local} trajectories per batch shard "
                         f"(batch {batch_size} over {shards} shards).")
    return local // micro


def _micro_split(x, n_micro: int, shards: int):
    """[B, ...] -> [n_micro, B / n_micro, ...]; each shard's rows stay on that shard."""
    B = x.shape[0]
    x = x.reshape((shards, n_micro, B // (shards * n_micro)) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((n_micro, B // n_micro) + x.shape[3:])


def _micro_merge(x, shards: int):
    """Inverse of :func:`_micro_split`: [n_micro, B / n_micro, ...] -> [B, ...]."""
    n_micro, mb = x.shape[:2]
    x = jnp.swapaxes(x.reshape((n_micro, shards, mb // shards) + x.shape[2:]), 0, 1)
    return x.reshape((n_micro * mb,) + x.shape[3:])


_NOT_SUMMED = ("beta", "delta_per_rollout")


def _accumulated_grads(system: LOPDSystem, state, frozen, batch, rng, argnums, grad_shardings, with_shares=False):
    """Gradients and metrics of the whole batch from micro-batches under ``lax.scan``.

    Every normalizer (supervised tokens N, rollouts R, anchor elements) comes from the
    whole batch's masks up front (:func:`lopd_jax.method.losses.lopd_totals`) and beta is fixed
    during the step, so each micro-batch's loss is an exact share of the whole batch's and
    the summed gradients (accumulated in fp32) equal the one-pass gradients up to float
    rounding. LoRA dropout (default 0) draws per micro-batch. ``with_shares`` also
    accumulates the margin and anchor terms' composer gradients and adds
    :func:`grad_shares` to the metrics.
    """
    cfg = system.step_cfg
    B = batch["tokens"].shape[0]
    shards = system.batch_shards(B)
    n_micro = num_micro_steps(system, B)
    d = system.model_cfg.hidden_size
    totals = losses.lopd_totals(batch["loss_mask"][:, 1:], system.composer_cfg.num_slots * d)
    micro = {k: _micro_split(jnp.asarray(v), n_micro, shards) for k, v in batch.items()}
    if system.rules is not None:
        micro = {k: jax.lax.with_sharding_constraint(
            v, system.rules.sharding((None, "act_batch") + (None,) * (v.ndim - 2), v.shape)) for k, v in micro.items()}
    params = (state["student"], state["composer"])
    params = tuple(params[i] for i in argnums)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731

    with_composer = with_shares and len(argnums) == 2
    term_sh = None if grad_shardings is None or not with_composer else (grad_shardings[1],) * 2

    def body(acc, xs):
        mb, i = xs
        fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, mb, jax.random.fold_in(rng, i), totals)  # noqa: E731
        metrics, grads, per_term = lopd_grads(fn, state["student"], state["composer"], len(argnums) == 2,
                                              with_composer)
        g = jax.tree.map(jnp.add, acc[0], f32(grads))
        terms = None if per_term is None else jax.tree.map(jnp.add, acc[1], f32(per_term))
        if grad_shardings is not None:
            g = jax.lax.with_sharding_constraint(g, grad_shardings)
            terms = terms if term_sh is None else jax.lax.with_sharding_constraint(terms, term_sh)
        return (g, terms), metrics

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    term_zeros = (zeros[1], zeros[1]) if with_composer else None
    (grads, per_term), per_micro = jax.lax.scan(body, (zeros, term_zeros), (micro, jnp.arange(n_micro)),
                                                unroll=scans_unrolled())
    shares = grad_shares(grads[1], per_term) if with_composer else {}
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    metrics = {k: (v if k in _NOT_SUMMED else jnp.sum(v, axis=0)) for k, v in per_micro.items()}
    metrics.update(shares)
    metrics["beta"] = per_micro["beta"][0]
    metrics["delta_per_rollout"] = _micro_merge(per_micro["delta_per_rollout"], shards)
    return grads, losses.add_margin_constant(metrics, cfg.loss.margin)


def lopd_update(system: LOPDSystem, state, grads, metrics, rng, mean_reward, tokens):
    """The end of a LOPD step from the whole batch's gradients and metrics: one AdamW step
    each for the student and (unless frozen) the composer, the dual step on beta, the
    non-finite guard; ``rng`` becomes the state's key. Returns ``(state, metrics)``."""
    cfg = system.step_cfg
    metrics = {k: v for k, v in metrics.items() if k != "loss_terms"}  # a [3] vector: its gradients were the use
    new = dict(state)
    new["student"], new["student_opt"] = _apply(system.student_opt, grads[0], state["student_opt"], state["student"])
    metrics["student_grad_norm"] = optax.global_norm(grads[0])
    if not cfg.freeze_composer:
        new["composer"], new["composer_opt"] = _apply(system.composer_opt, grads[1], state["composer_opt"],
                                                      state["composer"])
        metrics["composer_grad_norm"] = optax.global_norm(grads[1])
    new["beta"] = losses.dual_update(state["beta"], cfg.loss.margin, metrics["delta"], cfg.eta_beta)
    if cfg.skip_nonfinite:  # the release skips a step whose gradient norm is not finite
        ok = all_finite(metrics["delta"], *(metrics[k] for k in ("student_grad_norm", "composer_grad_norm")
                                             if k in metrics))
        keys = [k for k in ("student", "student_opt", "composer", "composer_opt", "beta") if k in new]
        new.update(keep_if_finite(ok, {k: new[k] for k in keys}, {k: state[k] for k in keys}))
        metrics["nonfinite"] = 1.0 - ok.astype(jnp.float32)
    new["step"] = state["step"] + 1
    new["rng"] = rng
    metrics["beta_next"] = new["beta"]
    metrics["mean_reward"] = mean_reward
    metrics["tokens"] = tokens
    return new, metrics


def make_lopd_step(system: LOPDSystem, example_state, example_batch):
    """The fused LOPD step ``(state, frozen, batch) -> (state, metrics)``.

    One forward / backward gives both gradients: the student's (global token-mean KL) and
    the composer's (its KL weighting through the frozen teacher, the margin and anchor).
    Then one AdamW step each and the dual ascent on beta.

    With ``step_cfg.micro_batch`` smaller than the trajectories per batch shard, the
    forward / backward runs over micro-batches under a ``lax.scan`` inside the same jitted
    step, accumulating gradients exactly (:func:`_accumulated_grads`); the optimizer
    updates, the dual step and the metrics are those of the whole batch.
    """
    cfg = system.step_cfg
    state_sh = system.state_shardings(example_state)
    grad_sh = None if state_sh is None else (state_sh["student"], state_sh["composer"])

    def step(state, frozen, batch):
        rng, sub = jax.random.split(state["rng"])
        argnums = (0,) if cfg.freeze_composer else (0, 1)
        if num_micro_steps(system, batch["tokens"].shape[0]) > 1:
            grads, metrics = _accumulated_grads(system, state, frozen, batch, sub, argnums,
                                                None if grad_sh is None else tuple(grad_sh[i] for i in argnums),
                                                with_shares=True)
        else:
            fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, batch, sub)  # noqa: E731
            metrics, grads, per_term = lopd_grads(fn, state["student"], state["composer"], len(argnums) == 2)
            if per_term is not None:
                metrics.update(grad_shares(grads[1], per_term))
        return lopd_update(system, state, grads, metrics, rng, jnp.mean(batch["rewards"].astype(jnp.float32)),
                           jnp.sum(batch["attention_mask"].astype(jnp.float32)))

    return _jit(step, system, state_sh, system.frozen_shardings(), system.batch_shardings(example_batch))


def cold_start_loss(system: LOPDSystem, composer_p, frozen, batch, rng, total_tokens=None):
    """Token-mean NLL of assistant tokens under the teacher-format prompt with latents.

    ``total_tokens``: the whole batch's supervised tokens when ``batch`` is a
    length-bucketed pass of it (:mod:`train.bucketed_steps`): ``nll`` is then that pass's
    share of the whole batch's token mean."""
    frozen = sg(frozen)
    _, rows = per_trajectory(batch)
    exp_tokens, exp_mask = rows(batch["exp_tokens"]), rows(batch["exp_mask"])
    latents = system.latents(frozen, composer_p, exp_tokens, exp_mask, rng)
    teacher = system.backbone(frozen, sg(composer_p["lora"]))
    tokens, amask = batch["tokens"], batch["attention_mask"].astype(bool)
    slots = slot_mask(exp_mask, system.composer_cfg.num_latents)
    if is_packed(batch):  # the NLL is a global token mean: no per-trajectory view needed
        t_hidden = packed_teacher_hidden(teacher, batch, latents, slots)
    else:
        t_hidden = teacher_hidden_states(teacher, tokens, amask, batch["insert_at"], latents, system.layout, slots)
    loss_cfg = system.step_cfg.loss
    logp = chunked_token_logp(t_hidden[:, :-1], sg(teacher.lm_head_kernel()), tokens[:, 1:],
                              chunk_size=loss_cfg.logits_chunk, compute_dtype=system.model_cfg.jnp_dtype,
                              logits_dtype=loss_cfg.logits_jnp_dtype(system.model_cfg.jnp_dtype))
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    nll = (losses.nll_token_mean(logp, mask) if total_tokens is None
           else losses.masked_token_mean(-logp, mask, total_tokens))
    return nll, {"nll": nll, "tokens": jnp.sum(mask)}


def make_cold_start_step(system: LOPDSystem, example_state, example_batch):
    """Cold start ``(state, frozen, batch) -> (state, metrics)``: phi only, two clip groups."""

    def step(state, frozen, batch):
        rng, sub = jax.random.split(state["rng"])
        (loss, metrics), grads = jax.value_and_grad(
            lambda cp: cold_start_loss(system, cp, frozen, batch, sub), has_aux=True)(state["composer"])
        return cold_start_update(system, state, grads, metrics, rng)

    return _jit(step, system, system.cold_start_shardings(example_state), system.frozen_shardings(),
                system.batch_shardings(example_batch))


def cold_start_update(system: LOPDSystem, state, grads, metrics, rng):
    """The end of a cold-start step from the whole batch's composer gradients: one step of
    each clip group's optimizer, the non-finite guard; ``rng`` becomes the state's key.
    Returns ``(state, metrics)``."""
    new = dict(state)
    new["composer"], new["composer_opt"] = {}, {}
    for group, opt in system.cold_start_opt.items():
        new["composer"][group], new["composer_opt"][group] = _apply(
            opt, grads[group], state["composer_opt"][group], state["composer"][group])
        metrics[f"{group}_grad_norm"] = optax.global_norm(grads[group])
    if system.step_cfg.skip_nonfinite:
        ok = all_finite(*(metrics[f"{g}_grad_norm"] for g in system.cold_start_opt))
        new.update(keep_if_finite(ok, {k: new[k] for k in ("composer", "composer_opt")},
                                  {k: state[k] for k in ("composer", "composer_opt")}))
        metrics["nonfinite"] = 1.0 - ok.astype(jnp.float32)
    new["step"] = state["step"] + 1
    new["rng"] = rng
    return new, metrics


def grpo_loss(system: LOPDSystem, student_p, state, frozen, batch, group_size: int, total_tokens=None):
    """PPO-clip loss with group-normalized advantages (token mean), importance-corrected
    against the sampler's ``old_logp`` per ``steps.is_correction``
    (:func:`lopd_jax.method.losses.grpo_policy_loss`).

    A batch with ``advantages`` [B] (a length-bucketed pass, :mod:`train.bucketed_steps`)
    uses them as given (computed over whole groups of the whole batch); ``total_tokens``
    (the whole batch's supervised tokens) makes loss and mean metrics this pass's share.
    """
    student, use_lora = system.student(student_p, sg(frozen), state["composer"]["lora"])
    tokens, amask = batch["tokens"], batch["attention_mask"].astype(bool)
    hidden = student(tokens, attention_mask=amask, segment_ids=batch.get("segment_ids"), lora=use_lora,
                     return_hidden=True)
    logp = chunked_token_logp(hidden[:, :-1], student.lm_head_kernel(), tokens[:, 1:],
                              chunk_size=system.step_cfg.loss.logits_chunk, compute_dtype=system.model_cfg.jnp_dtype)
    view, rows = per_trajectory(batch)
    adv = (rows(batch["advantages"]).astype(jnp.float32) if "advantages" in batch
           else losses.group_advantages(batch["rewards"].astype(jnp.float32), group_size=group_size))
    mask = view(batch["loss_mask"][:, 1:].astype(jnp.float32))
    old = view(batch["old_logp"][:, 1:])
    logp = view(logp)
    n = total_tokens
    loss, policy_metrics = losses.grpo_policy_loss(logp, old, adv, mask, system.step_cfg.loss, n)
    ratio = jnp.exp(jnp.where(mask > 0, sg(logp) - old, 0.0))  # pi / pi_sampler per token (1 when on-policy)
    return loss, {"loss": loss, **policy_metrics,
                  "ratio_mean": losses.masked_token_mean(ratio, mask, n),
                  "ratio_max_dev": jnp.max(jnp.where(mask > 0, jnp.abs(ratio - 1.0), 0.0)),
                  "tokens": jnp.sum(mask)}


def make_grpo_step(system: LOPDSystem, example_state, example_batch, group_size: int = 4):
    """GRPO ``(state, frozen, batch) -> (state, metrics)`` on the student (docs/method.md)."""

    def step(state, frozen, batch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda sp: grpo_loss(system, sp, state, frozen, batch, group_size), has_aux=True)(state["student"])
        return grpo_update(system, state, grads, metrics, jnp.mean(batch["rewards"].astype(jnp.float32)))

    return _jit(step, system, system.state_shardings(example_state), system.frozen_shardings(),
                system.batch_shardings(example_batch))


def grpo_update(system: LOPDSystem, state, grads, metrics, mean_reward):
    """The end of a GRPO step from the whole batch's gradients: one AdamW step on the student."""
    new = dict(state)
    new["student"], new["student_opt"] = _apply(system.student_opt, grads, state["student_opt"], state["student"])
    metrics["student_grad_norm"] = optax.global_norm(grads)
    metrics["mean_reward"] = mean_reward
    new["step"] = state["step"] + 1
    return new, metrics
