"""Fused LM-head + weighted NLL with the gradient formed in the forward pass.

:func:`weighted_linear_nll` computes ``sum(w * -log pi(target)) / sum(w)`` (or over a given
batch-level ``total_weight``: a micro-batch's exact share) from final hidden states and the
LM-head kernel, chunk by chunk over the sequence, and forms the gradients with respect to
the hidden states and the head in the same pass (d loss / d logits = ``c * (softmax -
onehot)``); the backward only scales them by the cotangent. One step runs the three LM-head
matmuls plain autodiff runs, but never holds a ``[B, S, V]`` tensor, and saves the logits
that :func:`lopd_jax.method.losses_kl.chunked_token_logp` recomputes (docs/benchmarks.md).

Scope: the head's gradient accumulates across chunks inside the loop, which a sharded
batch would all-reduce once per chunk; so sharded steps keep ``chunked_token_logp`` and
the warm-up uses this function on a one-device mesh. Weights get no gradient;
``log pi(target)`` is also returned, without gradient, for metrics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lopd_jax.core.defaults import LOGITS_CHUNK
from lopd_jax.method.losses_kl import check_head_inputs, project_logits, scans_unrolled, sequence_chunks


def weighted_linear_nll(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    chunk_size: int = LOGITS_CHUNK,
    compute_dtype=jnp.float32,
    logits_dtype=jnp.float32,
    total_weight: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(loss, logp)``: the weighted token-mean NLL and ``log pi(target)`` per position.

    Args:
      hidden: ``[B, S, D]`` final hidden states (after the final norm).
      head: LM-head kernel ``[D, V]`` (``embedding.T`` for tied heads).
      targets: ``[B, S]`` int token ids.
      weights: ``[B, S]`` float token weights; tokens with weight <= 0 are left out, as in
        :func:`lopd_jax.method.losses.weighted_token_mean` (loss 0 when no token has weight).
      chunk_size: sequence positions per chunk (one chunk holds ``B * chunk_size`` rows of
        ``V`` logits). ``S`` is padded up to a multiple internally.
      compute_dtype, logits_dtype: as :func:`lopd_jax.method.losses_kl.project_logits`.
      total_weight: the denominator in place of ``sum(w)`` (e.g. the whole batch's weight
        when this call sees one length-bucketed pass of it, :mod:`train.bucketed_steps`);
        None: this call's own ``sum(w)``.

    Returns:
      ``loss`` (fp32 scalar, differentiable in ``hidden`` and ``head``) and ``logp``
      (``[B, S]`` fp32, stop-gradient).
    """
    check_head_inputs("weighted_linear_nll", hidden, head, targets)
    if weights.shape != targets.shape:
        raise ValueError(f"weights {weights.shape} must be [B, S] = {targets.shape}.")
    w = jax.lax.stop_gradient(weights.astype(jnp.float32))
    w = jnp.where(w > 0, w, 0.0)
    denom = jnp.sum(w) if total_weight is None else jnp.asarray(total_weight, jnp.float32)
    coef = w / jnp.maximum(denom, 1e-9)
    loss, logp = _fused(hidden, head, targets, coef, chunk_size, jnp.dtype(compute_dtype), jnp.dtype(logits_dtype))
    return loss, jax.lax.stop_gradient(logp)


def _forward(hidden, head, targets, coef, chunk_size, compute_dtype, logits_dtype, with_grads):
    """Loss, per-token log-probs and (``with_grads``) the loss's gradients (hidden, head)."""
    w = head.astype(compute_dtype)

    def body(d_head, xs):
        h, tgt, c = xs
        h = h.astype(compute_dtype)
        logits = project_logits(h, w, compute_dtype, logits_dtype)  # [B, C, V] fp32
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.exp(logits - row_max)
        total = jnp.sum(e, axis=-1, keepdims=True)
        lse = (row_max + jnp.log(total))[..., 0]
        logp = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0] - lse
        if not with_grads:
            return d_head, (jnp.sum(c * -logp), logp)
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == tgt[..., None]
        d_logits = (c[..., None] * (e / total - onehot.astype(jnp.float32))).astype(compute_dtype)
        d_h = jnp.einsum("bcv,dv->bcd", d_logits, w, preferred_element_type=jnp.float32)
        d_head = d_head + jnp.einsum("bcd,bcv->dv", h, d_logits, preferred_element_type=jnp.float32)
        return d_head, (jnp.sum(c * -logp), logp, d_h)

    chunks, unchunk = sequence_chunks([hidden, targets, coef], chunk_size)
    init = jnp.zeros(head.shape, jnp.float32) if with_grads else None
    d_head, outs = jax.lax.scan(body, init, chunks, unroll=scans_unrolled())
    loss, logp = jnp.sum(outs[0]), unchunk(outs[1])
    if not with_grads:
        return loss, logp, None, None
    return loss, logp, unchunk(outs[2]).astype(hidden.dtype), d_head.astype(head.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(hidden, head, targets, coef, chunk_size, compute_dtype, logits_dtype):
    # Without differentiation (metrics, evaluation) only the logits matmul runs.
    loss, logp, _, _ = _forward(hidden, head, targets, coef, chunk_size, compute_dtype, logits_dtype, False)
    return loss, logp


def _fused_fwd(hidden, head, targets, coef, chunk_size, compute_dtype, logits_dtype):
    loss, logp, d_hidden, d_head = _forward(hidden, head, targets, coef, chunk_size, compute_dtype, logits_dtype,
                                            True)
    return (loss, logp), (d_hidden, d_head, coef)


def _fused_bwd(chunk_size, compute_dtype, logits_dtype, res, cotangents):
    # ``logp`` leaves the public function stop-gradient, so only the loss's cotangent is
    # non-zero here.
    d_hidden, d_head, coef = res
    g = cotangents[0]
    return (g.astype(d_hidden.dtype) * d_hidden, g.astype(d_head.dtype) * d_head, None, jnp.zeros_like(coef))


_fused.defvjp(_fused_fwd, _fused_bwd)
