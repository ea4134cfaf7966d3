"""Importance correction for samples drawn by an older student (asynchronous rollouts).

The losses estimate expectations under the current student pi from samples of the
behaviour policy mu that sampled them (``old_logp``: mu's temperature-1 token log-probs,
aligned with the tokens). docs/method.md, "Importance correction for stale samples",
derives the weights: per token for GRPO's policy gradient (:func:`token_weights`), per
rollout with the length-normalised prefix ratio for the KL arms (:func:`sequence_weights`,
:func:`weighted_kl`). ``tis`` truncates a ratio at the cap C, ``mis`` drops a sample whose
ratio leaves [1/C, C]. Weights are detached; the metrics are shares of the whole batch's
token (rollout) means when totals are given, so passes and micro-batches sum to them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lopd_jax.method.loss_config import LossConfig
from lopd_jax.method.reductions import check_mask, masked_token_mean, row_means

__all__ = ["log_ratio", "ratio_weights", "token_weights", "sequence_weights", "weighted_kl"]

sg = jax.lax.stop_gradient


def log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """log pi - log mu per token, detached fp32 ``[B, S]``; 0 off the mask (where either
    log-prob may hold anything)."""
    m = check_mask(logp, mask)
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp {old_logp.shape} must match the current log-probs {logp.shape} "
                         "(both aligned with the predicted tokens).")
    return jnp.where(m, sg(logp.astype(jnp.float32)) - old_logp.astype(jnp.float32), 0.0)


def ratio_weights(log_r: jax.Array, correction: str, cap: float) -> tuple[jax.Array, jax.Array]:
    """``(w, flagged)`` elementwise from log ratios: ``tis`` w = min(e^log_r, C), flagged
    where the ratio exceeds C; ``mis`` w = 1 where the ratio is in [1/C, C] else 0, flagged
    where it is 0."""
    ratio = jnp.exp(log_r)
    if correction == "tis":
        return jnp.minimum(ratio, cap), (ratio > cap).astype(jnp.float32)
    if correction == "mis":
        keep = (ratio >= 1.0 / cap) & (ratio <= cap)
        return keep.astype(jnp.float32), 1.0 - keep.astype(jnp.float32)
    raise ValueError(f"is_correction={correction!r} has no weights; use 'tis' or 'mis'.")


def _flag_name(correction: str) -> str:
    return "is_clipped_fraction" if correction == "tis" else "is_masked_fraction"


def token_weights(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, correction: str, cap: float,
                  total_tokens=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token weights ``[B, S]`` (1 off the mask) from the ratios pi(a_t) / mu(a_t), and
    their metrics: ``is_weight_mean``, the share of tokens clipped (``tis``) or masked
    (``mis``), ``is_log_ratio_mean`` (token means; ``total_tokens`` as in
    :func:`lopd_jax.method.reductions.masked_token_mean`)."""
    log_r = log_ratio(logp, old_logp, mask)
    w, flagged = ratio_weights(log_r, correction, cap)
    return w, {"is_weight_mean": masked_token_mean(w, mask, total_tokens),
               _flag_name(correction): masked_token_mean(flagged, mask, total_tokens),
               "is_log_ratio_mean": masked_token_mean(log_r, mask, total_tokens)}


def sequence_weights(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, correction: str, cap: float,
                     total_tokens=None, total_rollouts=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-rollout weights ``[B]`` from rho_i = exp(mean over rollout i's supervised tokens
    of log pi - log mu) (1 for a rollout without supervised tokens), and their metrics:
    ``is_weight_mean`` (token mean of w_i over the supervised tokens), the share of
    rollouts with supervised tokens clipped (``tis``) or masked (``mis``; its denominator:
    ``total_rollouts`` or the batch's own count), ``is_log_ratio_mean`` (token mean)."""
    log_r = log_ratio(logp, old_logp, mask)
    seq_log_r, n = row_means(log_r, mask.astype(bool))
    w, flagged = ratio_weights(seq_log_r, correction, cap)
    has = (n > 0).astype(jnp.float32)
    rollouts = jnp.sum(has) if total_rollouts is None else total_rollouts
    w_tok = jnp.broadcast_to(w[:, None], mask.shape)
    return w, {"is_weight_mean": masked_token_mean(w_tok, mask, total_tokens),
               _flag_name(correction): jnp.sum(flagged * has) / jnp.maximum(rollouts, 1.0),
               "is_log_ratio_mean": masked_token_mean(log_r, mask, total_tokens)}


def weighted_kl(kl: jax.Array, student_logp: jax.Array, old_logp: jax.Array | None, mask: jax.Array,
                loss: LossConfig, total_tokens=None, total_rollouts=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The per-token KL ``[B, S]`` of the KL arms with ``loss.is_correction``'s sequence-level
    weight of each rollout applied (:func:`sequence_weights` of the current student's token
    log-probs against ``old_logp``), and the weights' metrics; with ``none``, ``(kl, {})``.
    Being detached, the weight scales the student's and the composer's KL gradients alike."""
    if loss.is_correction == "none":
        return kl, {}
    if old_logp is None:
        raise ValueError(f"steps.is_correction={loss.is_correction} needs the behaviour log-probs, but the batch "
                         "has no 'old_logp' [B, S] (the sampler's temperature-1 log-probs aligned with the tokens: "
                         "training_arrays(...)['raw_logprobs'], as train.batches.lopd_batch and the arms' batches "
                         "carry them); build the batch with them or set steps.is_correction=none.")
    w, metrics = sequence_weights(student_logp, old_logp, mask, loss.is_correction, loss.is_cap, total_tokens,
                                  total_rollouts)
    return kl * w[:, None].astype(kl.dtype), metrics
