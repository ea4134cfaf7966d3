"""Masked reductions of per-token arrays: the token and rollout means every loss uses.

Arrays are batch-major (``[B, S]`` per token, ``[B]`` per rollout); a mask is bool or float
0/1 ``[B, S]``. Masked-out entries may hold any value (inf / NaN included) without
affecting a result. An optional total replaces the batch's own count as a denominator,
so a micro-batch's (or a length-bucketed pass's) value is its share of the whole batch's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_mask", "row_counts", "row_means", "masked_token_mean", "weighted_token_mean", "rollout_mean"]


def check_mask(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``mask`` as bool after checking that it and ``x`` are both ``[B, S]`` of one shape."""
    if x.shape != mask.shape or x.ndim != 2:
        raise ValueError(
            f"values {x.shape} and mask {mask.shape} must both be [B, S]; build the "
            "supervision mask with the same padding as the token arrays."
        )
    return mask.astype(bool)


def row_counts(m: jax.Array) -> jax.Array:
    """Supervised tokens per rollout ``n_i`` as fp32 ``[B]``."""
    return jnp.sum(m, axis=1, dtype=jnp.float32)


def row_means(x: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked mean inside each rollout (0 for empty rows) and the counts ``n_i``."""
    n = row_counts(m)
    sums = jnp.sum(jnp.where(m, x.astype(jnp.float32), 0.0), axis=1)
    return sums / jnp.maximum(n, 1.0), n


def masked_token_mean(x: jax.Array, mask: jax.Array, total_tokens=None) -> jax.Array:
    """Global token mean sum(mask * x) / sum(mask); 0 (not NaN) when the mask is empty.

    ``mask`` is bool or float 0/1 ``[B, S]``; masked-out entries of ``x`` may hold any
    value, including inf / NaN, without affecting the result. ``total_tokens`` replaces
    sum(mask) as the denominator (a micro-batch's share of a larger batch's mean).
    """
    m = check_mask(x, mask)
    total = jnp.sum(jnp.where(m, x.astype(jnp.float32), 0.0))
    denom = jnp.sum(m, dtype=jnp.float32) if total_tokens is None else total_tokens
    return total / jnp.maximum(denom, 1.0)


def weighted_token_mean(x: jax.Array, weight: jax.Array) -> jax.Array:
    """sum(weight * x) / sum(weight) over the tokens with ``weight > 0`` (float ``[B, S]``);
    0 when no token has weight. With 0/1 weights it is :func:`masked_token_mean`."""
    w = weight.astype(jnp.float32)
    check_mask(x, w)
    total = jnp.sum(jnp.where(w > 0, x.astype(jnp.float32), 0.0) * w)
    return total / jnp.maximum(jnp.sum(jnp.where(w > 0, w, 0.0)), 1e-9)


def rollout_mean(x: jax.Array, mask: jax.Array, total_rollouts=None) -> jax.Array:
    """Token mean inside each rollout, then mean over rollouts with >= 1 supervised token.

    Returns 0 when no rollout has a supervised token. ``total_rollouts`` replaces the
    number of such rollouts as the denominator (micro-batch share).
    """
    m = check_mask(x, mask)
    means, n = row_means(x, m)
    has = (n > 0).astype(jnp.float32)
    denom = jnp.sum(has) if total_rollouts is None else total_rollouts
    return jnp.sum(means * has) / jnp.maximum(denom, 1.0)
