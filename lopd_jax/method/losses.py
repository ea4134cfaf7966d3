"""LOPD losses: aggregation, privilege margin, anchor, dual ascent, fused objective, GRPO.

docs/method.md, "One LOPD step", "Cold start" and "Baselines in brief"; the settings are one
:class:`lopd_jax.method.loss_config.LossConfig`. All functions are pure JAX and jit-able; arrays
are batch-major (``[B, S]`` per-token, ``[B]`` per rollout). Under
SPMD ``jit`` the sums below run over the global batch, so token means are global.

The KL itself and the chunked LM-head projection live in :mod:`lopd_jax.method.losses_kl`, the
masked means in :mod:`lopd_jax.method.reductions` (both re-exported here), the importance
correction of stale samples in :mod:`lopd_jax.method.importance`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lopd_jax.method import importance, packing
from lopd_jax.method.loss_config import COMPOSER_KL_WEIGHTINGS, LossConfig
from lopd_jax.method.losses_kl import (
    TAIL_LOG_CLAMP,
    chunked_distill_stats,
    chunked_token_logp,
    project_logits,
    scan_sequence_chunks,
    topm_tail_reverse_kl,
)
from lopd_jax.method.reductions import (
    check_mask,
    masked_token_mean,
    rollout_mean,
    row_counts,
    row_means,
    weighted_token_mean,
)

__all__ = [
    "TAIL_LOG_CLAMP",
    "chunked_distill_stats",
    "chunked_token_logp",
    "project_logits",
    "scan_sequence_chunks",
    "topm_tail_reverse_kl",
    "masked_token_mean",
    "weighted_token_mean",
    "rollout_mean",
    "privilege_delta",
    "advantages_from_rewards",
    "anchor_loss",
    "dual_update",
    "composer_kl_grad_scale",
    "lopd_totals",
    "lopd_loss_from_stats",
    "add_margin_constant",
    "lopd_objective",
    "group_advantages",
    "ppo_clip_loss",
    "ppo_clip_fraction",
    "grpo_policy_loss",
    "nll_token_mean",
]


def privilege_delta(
    teacher_logp: jax.Array,
    student_logp: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    total_tokens=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Privilege margin Delta (docs/method.md, "Privilege margin").

    delta = teacher_logp - stop_grad(student_logp) per token; delta_i = A_i * mean_i(delta)
    over rollout i's n_i supervised tokens (0 if n_i = 0); Delta = sum n_i delta_i / sum n_i.

    Args:
      teacher_logp, student_logp: ``[B, S]`` log-probs of the sampled tokens.
      mask: ``[B, S]`` supervision mask.
      advantages: ``[B]`` per-rollout advantages A_i.
      total_tokens: replaces sum n_i as the denominator (micro-batch share of Delta).

    Returns:
      ``(Delta scalar, delta_i [B], n_i [B])``. Gradient flows only through teacher_logp.
    """
    m = check_mask(teacher_logp, mask)
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(
            f"student_logp {student_logp.shape} must match teacher_logp {teacher_logp.shape}."
        )
    if advantages.shape != (teacher_logp.shape[0],):
        raise ValueError(
            f"advantages {advantages.shape} must be one per rollout, shape "
            f"({teacher_logp.shape[0]},); compute them with advantages_from_rewards."
        )
    delta = teacher_logp.astype(jnp.float32) - jax.lax.stop_gradient(
        student_logp.astype(jnp.float32)
    )
    means, n = row_means(delta, m)
    delta_i = advantages.astype(jnp.float32) * means
    denom = jnp.sum(n) if total_tokens is None else total_tokens
    big_delta = jnp.sum(n * delta_i) / jnp.maximum(denom, 1.0)
    return big_delta, delta_i, n


def advantages_from_rewards(rewards: jax.Array) -> jax.Array:
    """LOPD advantage A = 2r - 1, mapping rewards in [0, 1] to [-1, 1] (docs/method.md, "Rollout")."""
    return 2.0 * jnp.asarray(rewards, jnp.float32) - 1.0


def anchor_loss(latents: jax.Array, latents0: jax.Array, total_elements=None) -> jax.Array:
    """mean((c - stop_grad(c0))^2) over all elements, in fp32 (docs/method.md, "Anchor").

    ``total_elements`` replaces the element count (micro-batch share of the mean)."""
    if latents.shape != latents0.shape:
        raise ValueError(
            f"latents {latents.shape} and anchor latents {latents0.shape} must match; "
            "compute c_phi0 for the same tasks and retrieved experiences."
        )
    diff = latents.astype(jnp.float32) - jax.lax.stop_gradient(latents0.astype(jnp.float32))
    if total_elements is None:
        return jnp.mean(jnp.square(diff))
    return jnp.sum(jnp.square(diff)) / total_elements


def dual_update(beta, margin, delta, eta) -> jax.Array:
    """Dual ascent on the privilege constraint: max(0, beta + eta * (margin - Delta))."""
    beta = jnp.asarray(beta, jnp.float32)
    delta = jax.lax.stop_gradient(jnp.asarray(delta, jnp.float32))
    return jnp.maximum(0.0, beta + eta * (margin - delta))


def lopd_totals(mask: jax.Array, latent_elements_per_rollout: int = 0) -> dict[str, jax.Array]:
    """Global normalizers of the LOPD objective from a whole batch's supervision mask.

    ``tokens`` = sum of the mask (N), ``rollouts`` = rollouts with >= 1 supervised token
    (R), ``anchor_elements`` = rollouts * latent elements per rollout. Passed as
    ``totals`` to :func:`lopd_objective` on each micro-batch, they make the micro-batch
    losses (and metrics) partial sums of the whole batch's: gradient accumulation is exact.
    """
    n = row_counts(mask.astype(bool))
    return {"tokens": jnp.sum(n), "rollouts": jnp.sum((n > 0).astype(jnp.float32)),
            "anchor_elements": jnp.float32(mask.shape[0] * latent_elements_per_rollout)}


def composer_kl_grad_scale(mask: jax.Array, composer_kl_weighting: str, totals=None) -> jax.Array | None:
    """Per-token factor turning the token-mean KL gradient into the composer's weighting.

    The student's KL weight per supervised token is 1/N (N = all supervised tokens); the
    rollout-mean weight is 1/(n_i R) (R = rollouts with n_i >= 1). Their ratio N/(n_i R),
    applied to the gradient the KL sends into the teacher's logits only, gives the composer
    exactly the gradient of ``rollout_mean(kl)``. Returns None for ``token_mean`` (ratio 1).
    ``totals`` (:func:`lopd_totals`) gives N and R of the whole batch for a micro-batch.
    """
    if composer_kl_weighting not in COMPOSER_KL_WEIGHTINGS:
        raise ValueError(
            f"composer_kl_weighting={composer_kl_weighting!r}; choose one of "
            f"{COMPOSER_KL_WEIGHTINGS}."
        )
    if composer_kl_weighting == "token_mean":
        return None
    m = mask.astype(bool)
    n = row_counts(m)
    total = jnp.maximum(jnp.sum(n) if totals is None else totals["tokens"], 1.0)
    rollouts = jnp.maximum(jnp.sum((n > 0).astype(jnp.float32)) if totals is None else totals["rollouts"], 1.0)
    ratio = total / (jnp.maximum(n, 1.0) * rollouts)
    return jnp.where(m, ratio[:, None], 0.0)


def lopd_loss_from_stats(
    stats: dict[str, jax.Array],
    mask: jax.Array,
    advantages: jax.Array,
    beta,
    latents: jax.Array | None = None,
    latents0: jax.Array | None = None,
    *,
    loss: LossConfig = LossConfig(),
    totals: dict[str, jax.Array] | None = None,
    reference_logp: jax.Array | None = None,
    old_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L = L_distill + beta (m - Delta) + lambda anchor from per-token stats, with m, lambda
    and the weightings from ``loss``.

    docs/method.md, "Objective and update".

    ``composer_margin_weighting`` sets the Delta inside the loss, whose gradient reaches
    only the composer: ``rollout_mean`` (the release, which averages per-rollout losses
    kl_i + beta (m - delta_i) + lambda anchor_i) uses the mean of delta_i over rollouts with
    supervised tokens; ``token_mean`` uses the token-weighted Delta. The ``delta`` metric
    (and so the dual step) is always the token-weighted Delta.

    ``stats`` holds ``kl``, ``student_logp``, ``teacher_logp`` and optionally
    ``teacher_topm_mass`` (``[B, S]``, as from :func:`chunked_distill_stats`). ``beta`` is
    held fixed (stop-gradient). The value's KL part is always the global token mean;
    ``composer_kl_weighting`` only names the composer KL metric here -- the composer's
    gradient weighting is set by the ``teacher_kl_grad_scale`` the stats were built with
    (see :func:`lopd_objective`). Latents may both be None (no anchor term).

    With ``totals`` (:func:`lopd_totals` of the whole batch) this is one micro-batch's
    share: every mean uses the whole batch's denominator, the loss omits the constant
    ``beta * m`` and the metrics are partial sums (``margin_gap`` = -Delta share), so
    summing over micro-batches and passing the sums to :func:`add_margin_constant` gives
    the whole batch's values; ``beta`` and ``delta_per_rollout`` are not summed.

    ``loss_terms`` (differentiable, [3]) holds the loss's three terms -- distillation,
    ``-beta Delta_w`` and ``lambda anchor`` -- summing to the loss less the constant
    ``beta m``, for per-term gradients. ``reference_logp`` [B, S] (the teacher's log-probs
    without latents) adds ``delta_vs_plain_teacher``: Delta with it in the student's place.

    ``loss.is_correction`` other than ``none`` weights each rollout's per-token KL by its
    detached sequence-level importance weight against the behaviour log-probs ``old_logp``
    [B, S] (:func:`lopd_jax.method.importance.weighted_kl`; required then): the KL value,
    both its gradients and the KL metrics are the corrected ones, and the ``is_*`` metrics
    join. Delta (so the margin term and the dual step), the logp gap and the anchor stay
    unweighted: they are statistics of the batch as sampled, not on-policy expectations.
    """
    if (latents is None) != (latents0 is None):
        raise ValueError("pass both latents and latents0 for the anchor, or neither.")
    tot = totals or {}
    n_tok, n_roll, n_elem = tot.get("tokens"), tot.get("rollouts"), tot.get("anchor_elements")
    kl, is_metrics = importance.weighted_kl(stats["kl"], stats["student_logp"], old_logp, mask, loss, n_tok, n_roll)
    distill = masked_token_mean(kl, mask, n_tok)
    big_delta, delta_i, n = privilege_delta(stats["teacher_logp"], stats["student_logp"], mask, advantages, n_tok)
    anchor = jnp.float32(0.0) if latents is None else anchor_loss(latents, latents0, n_elem)
    beta = jax.lax.stop_gradient(jnp.asarray(beta, jnp.float32))
    m_const = loss.margin if totals is None else 0.0  # a share: add_margin_constant adds it once to the sum
    margin_delta = _margin_delta(loss.composer_margin_weighting, big_delta, delta_i, n, n_roll)
    value = distill + beta * (m_const - margin_delta) + loss.anchor_weight * anchor
    terms = {"kl": kl, "distill": distill, "delta": big_delta, "delta_i": delta_i, "n": n, "anchor": anchor,
             "beta": beta, "m_const": m_const, "margin_delta": margin_delta, "value": value}
    return value, _lopd_metrics(stats, mask, advantages, loss, terms, is_metrics, reference_logp, n_tok, n_roll)


def _margin_delta(composer_margin_weighting, big_delta, delta_i, n, n_roll):
    """The Delta of the loss's margin term: the mean of delta_i over rollouts with supervised
    tokens (``rollout_mean``; ``n_roll`` replaces their count) or the token-weighted Delta."""
    if composer_margin_weighting == "rollout_mean":
        has = (n > 0).astype(jnp.float32)
        n_delta_rollouts = jnp.sum(has) if n_roll is None else n_roll
        return jnp.sum(delta_i * has) / jnp.maximum(n_delta_rollouts, 1.0)
    return big_delta


def _lopd_metrics(stats, mask, advantages, loss, terms, is_metrics, reference_logp, n_tok, n_roll):
    """The metrics of :func:`lopd_loss_from_stats` from its ``terms`` (stop-gradient, but for
    the differentiable ``loss_terms``)."""
    sg = jax.lax.stop_gradient
    kl, distill, big_delta, n = terms["kl"], terms["distill"], terms["delta"], terms["n"]
    if loss.composer_kl_weighting == "rollout_mean":
        composer_kl = rollout_mean(sg(kl), mask, n_roll)
    else:
        composer_kl = sg(distill)
    gap = masked_token_mean(sg(stats["teacher_logp"] - stats["student_logp"]), mask, n_tok)
    metrics = {
        "loss": sg(terms["value"]),
        "distill_kl": sg(distill),
        "composer_kl": composer_kl,
        "delta": sg(big_delta),
        "margin_gap": sg(terms["m_const"] - big_delta),
        "beta": terms["beta"],
        "anchor": sg(terms["anchor"]),
        "teacher_student_logp_gap": gap,
        "supervised_tokens": jnp.sum(n),
        "supervised_rollouts": jnp.sum((n > 0).astype(jnp.float32)),
        "delta_per_rollout": sg(terms["delta_i"]),
        **is_metrics,
    }
    if "teacher_topm_mass" in stats:
        metrics["teacher_topm_mass"] = masked_token_mean(sg(stats["teacher_topm_mass"]), mask, n_tok)
    if reference_logp is not None:
        metrics["delta_vs_plain_teacher"] = sg(privilege_delta(stats["teacher_logp"], reference_logp, mask,
                                                               advantages, n_tok)[0])
    # without the constant beta * m: shares of micro-batches and passes then sum to the whole batch's
    beta = terms["beta"]
    metrics["loss_terms"] = jnp.stack([distill, -beta * terms["margin_delta"], loss.anchor_weight * terms["anchor"]])
    return metrics


def add_margin_constant(summed: dict[str, jax.Array], margin: float) -> dict[str, jax.Array]:
    """The whole batch's LOPD metrics from the sum of its shares' metrics.

    Each share (:func:`lopd_loss_from_stats` with ``totals``: a micro-batch or a pass) leaves
    the constant of the margin term out, so that it enters the sum once: this adds
    ``beta * m`` to ``loss`` and ``m`` to ``margin_gap``. ``summed["beta"]`` is the step's
    beta (not summed). The constant has no gradient, so the summed gradients need nothing.
    """
    metrics = dict(summed)
    metrics["loss"] = metrics["loss"] + metrics["beta"] * margin
    metrics["margin_gap"] = metrics["margin_gap"] + margin
    return metrics


def lopd_objective(
    student_hidden: jax.Array,
    student_head: jax.Array,
    teacher_hidden: jax.Array,
    teacher_head: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    beta,
    latents: jax.Array | None = None,
    latents0: jax.Array | None = None,
    *,
    loss: LossConfig = LossConfig(),
    compute_dtype=jnp.float32,
    totals: dict[str, jax.Array] | None = None,
    reference_logp: jax.Array | None = None,
    unpack_index: jax.Array | None = None,
    old_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The fused LOPD scalar for one step: student and composer gradients in one backward.

    The method asks for two differently weighted KL terms: the student minimizes the global
    token-mean KL, the composer the ``composer_kl_weighting`` KL. Written out, that is
    ``token_mean(kl(S, sg(T))) + [w_C(kl(sg(S), T)) - sg(...)]``. Because the student
    reaches the KL only through ``student_hidden``/``student_head`` and the composer only
    through ``teacher_hidden`` (its latents), the same gradients come from ONE KL pass:
    the value is the token mean, and the gradient the KL sends into the teacher's logits is
    multiplied per token by ``w_C / w_token`` (:func:`composer_kl_grad_scale`). So:

    * d loss / d student params = d token_mean(kl) (the margin term has none: the student
      log-prob in Delta is stop-gradient; the anchor does not involve the student);
    * d loss / d composer params = d w_C(kl) - beta d Delta_w + lambda d anchor, with
      Delta_w the ``composer_margin_weighting`` mean of the per-rollout deltas (see
      :func:`lopd_loss_from_stats`).

    The caller stop-gradients whatever is frozen (the teacher's head / theta0 weights).

    Args:
      student_hidden, teacher_hidden: ``[B, S, D]`` final hidden states, position-aligned.
      student_head, teacher_head: ``[D, V]`` LM-head kernels.
      targets: ``[B, S]`` sampled token ids; mask: ``[B, S]`` supervision mask.
      advantages: ``[B]`` (A = 2r - 1); beta: current dual variable (held fixed).
      latents, latents0: c_phi and the cold-start c_phi0 for the anchor (or both None).
      loss: the objective's settings (margin, anchor weight, weightings, top-M, LM-head
        chunk and logits dtype).
      compute_dtype: the model's compute dtype (the LM-head inputs are cast to it).
      totals: the whole batch's :func:`lopd_totals` when this is one micro-batch of it
        (see :func:`lopd_loss_from_stats`); None = this is the whole batch.
      reference_logp: the teacher's token log-probs without latents (optional; see
        :func:`lopd_loss_from_stats`).
      unpack_index: ``[P, K, L]`` when the rows are packed (:mod:`lopd_jax.method.packing`):
        the hidden states, targets, mask and ``reference_logp`` are packed rows, while
        ``advantages`` and the latents are per trajectory ``[P * K, ...]``. The LM-head
        statistics run on the packed rows; every per-rollout reduction on their
        per-trajectory view.
      old_logp: ``[B, S]`` the behaviour policy's log-probs of ``targets`` (packed like
        them), for ``loss.is_correction`` (see :func:`lopd_loss_from_stats`).

    Returns:
      ``(loss, metrics)``; metrics are stop-gradient scalars (plus ``delta_per_rollout``).
    """
    scale, mask_u = _teacher_kl_grad_scale(mask, loss.composer_kl_weighting, totals, unpack_index)
    stats = _distill_stats(student_hidden, student_head, teacher_hidden, teacher_head, targets, loss,
                           compute_dtype, scale)
    if unpack_index is not None:
        stats, mask, reference_logp, old_logp = _unpack_rows(stats, mask_u, reference_logp, old_logp, unpack_index)
    return lopd_loss_from_stats(stats, mask, advantages, beta, latents, latents0, loss=loss, totals=totals,
                                reference_logp=reference_logp, old_logp=old_logp)


def _teacher_kl_grad_scale(mask, composer_kl_weighting, totals, unpack_index):
    """``(scale, per-trajectory mask)``: :func:`composer_kl_grad_scale` on the rows the LM head
    sees -- for packed rows computed per trajectory and scattered back (mask None if unpacked)."""
    if unpack_index is None:
        return composer_kl_grad_scale(mask, composer_kl_weighting, totals), None
    mask_u = packing.unpack(mask, unpack_index)
    scale = composer_kl_grad_scale(mask_u, composer_kl_weighting, totals)
    scale = None if scale is None else packing.scatter(scale, unpack_index, mask.shape[1])
    return scale, mask_u


def _distill_stats(student_hidden, student_head, teacher_hidden, teacher_head, targets, loss, compute_dtype, scale):
    """The per-token LM-head statistics (:func:`chunked_distill_stats`) with ``loss``'s settings."""
    return chunked_distill_stats(
        student_hidden,
        student_head,
        teacher_hidden,
        teacher_head,
        targets,
        top_m=loss.top_m,
        chunk_size=loss.logits_chunk,
        compute_dtype=compute_dtype,
        teacher_kl_grad_scale=scale,
        logits_dtype=loss.logits_jnp_dtype(compute_dtype),
    )


def _unpack_rows(stats, mask_u, reference_logp, old_logp, unpack_index):
    """Packed rows' stats and optional log-probs in their per-trajectory view, with ``mask_u``."""
    stats = {k: packing.unpack(v, unpack_index) for k, v in stats.items()}
    reference_logp, old_logp = (None if x is None else packing.unpack(x, unpack_index)
                                for x in (reference_logp, old_logp))
    return stats, mask_u, reference_logp, old_logp


def group_advantages(
    rewards: jax.Array, eps: float = 1e-6, *, group_size: int | None = None, ddof: int = 1
) -> jax.Array:
    """GRPO advantages (r - mean_group) / (std_group + eps) (docs/method.md, "Baselines in brief").

    Args:
      rewards: ``[B, G]``, or flat ``[B * G]`` with rollouts of a task adjacent (then
        ``group_size`` is required).
      eps: added to the group standard deviation.
      group_size: G for flat input.
      ddof: 1 = unbiased std as ``torch.std`` (TRL, verl); 0 = population std.

    Returns:
      advantages with the shape of ``rewards``; a constant group gives zeros.
    """
    r = jnp.asarray(rewards, jnp.float32)
    flat = r.ndim == 1
    if flat:
        if group_size is None or group_size < 1 or r.shape[0] % group_size:
            raise ValueError(
                f"flat rewards {r.shape} need group_size dividing their length (got "
                f"{group_size!r}); or pass rewards shaped [B, G]."
            )
        r = r.reshape(-1, group_size)
    elif r.ndim != 2:
        raise ValueError(f"rewards {r.shape} must be [B, G] or [B * G].")
    if r.shape[1] - ddof < 1:
        raise ValueError(f"group size {r.shape[1]} is too small for ddof={ddof}.")
    std = jnp.std(r, axis=1, keepdims=True, ddof=ddof)
    adv = (r - jnp.mean(r, axis=1, keepdims=True)) / (std + eps)
    return adv.reshape(-1) if flat else adv


def _ppo_terms(logp_new, logp_old, advantages, mask, clip_eps):
    m = check_mask(logp_new, mask)
    if logp_old.shape != logp_new.shape:
        raise ValueError(f"logp_old {logp_old.shape} must match logp_new {logp_new.shape}.")
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.shape == (logp_new.shape[0],):
        adv = adv[:, None]
    elif adv.shape != logp_new.shape:
        raise ValueError(
            f"advantages {adv.shape} must be per rollout [{logp_new.shape[0]}] or per "
            f"token {logp_new.shape}."
        )
    # Masked positions may hold garbage log-probs; zero them before exp.
    log_ratio = jnp.where(
        m, logp_new.astype(jnp.float32) - jax.lax.stop_gradient(logp_old.astype(jnp.float32)), 0.0
    )
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return m, adv, ratio, clipped


def ppo_clip_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_eps: float,
    total_tokens=None,
    weights: jax.Array | None = None,
) -> jax.Array:
    """PPO-clip policy loss, token mean: -min(r A, clip(r, 1-eps, 1+eps) A), r = e^(new-old).

    ``advantages`` is per rollout ``[B]`` or per token ``[B, S]``; ``logp_old`` is treated
    as a constant. ``total_tokens``: the whole batch's supervised tokens when this is one
    micro-batch of it (the loss is then that micro-batch's share of the batch's mean).
    ``weights`` ``[B, S]`` (held constant) multiply each token's term (importance weights).
    """
    m, adv, ratio, clipped = _ppo_terms(logp_new, logp_old, advantages, mask, clip_eps)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if weights is not None:
        per_token = per_token * jax.lax.stop_gradient(weights.astype(jnp.float32))
    return masked_token_mean(per_token, m, total_tokens)


def ppo_clip_fraction(
    logp_new: jax.Array,
    logp_old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_eps: float,
    total_tokens=None,
) -> jax.Array:
    """Fraction of supervised tokens whose clipped branch is active (no gradient);
    ``total_tokens`` as for :func:`ppo_clip_loss`."""
    m, adv, ratio, clipped = _ppo_terms(logp_new, logp_old, advantages, mask, clip_eps)
    active = (clipped * adv < ratio * adv).astype(jnp.float32)
    return jax.lax.stop_gradient(masked_token_mean(active, m, total_tokens))


def grpo_policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    loss: LossConfig = LossConfig(),
    total_tokens=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO's PPO-clip loss (epsilon ``loss.grpo_clip_eps``) and metrics (``clip_fraction``).

    With ``loss.is_correction == "none"`` the ratio is pi / mu against the behaviour
    log-probs ``old_logp`` (:func:`ppo_clip_loss`, as on-policy). Otherwise decoupled PPO:
    the ratio's reference is the proximal policy, the current one held fixed (one update per
    batch: r = 1 with r's gradient), and each token's clipped term is weighted by its
    detached token-level importance weight of pi against mu
    (:func:`lopd_jax.method.importance.token_weights`), whose ``is_*`` metrics join.
    ``total_tokens`` as for :func:`ppo_clip_loss`.
    """
    eps = loss.grpo_clip_eps
    if loss.is_correction == "none":
        ref, weights, metrics = old_logp, None, {}
    else:
        weights, metrics = importance.token_weights(logp, old_logp, mask, loss.is_correction, loss.is_cap,
                                                    total_tokens)
        ref = jax.lax.stop_gradient(logp)
    value = ppo_clip_loss(logp, ref, advantages, mask, eps, total_tokens, weights=weights)
    return value, {"clip_fraction": ppo_clip_fraction(logp, ref, advantages, mask, eps, total_tokens), **metrics}


def nll_token_mean(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Cold-start loss: token-mean NLL of the masked tokens (docs/method.md, "Cold start")."""
    return masked_token_mean(-logp, mask)
