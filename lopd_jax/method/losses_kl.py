"""Top-M + tail reverse KL and chunked LM-head statistics (docs/method.md, "Distillation loss").

Two entry points compute the same per-token quantities:

* :func:`topm_tail_reverse_kl` -- the plain reference on materialized logits ``[B, S, V]``.
* :func:`chunked_distill_stats` / :func:`chunked_token_logp` -- the production path. They
  take final hidden states (after the final norm) and LM-head kernels and project to logits
  one sequence chunk at a time inside ``jax.lax.scan``; the chunk body is wrapped in
  ``jax.checkpoint`` so the backward pass recomputes each chunk's logits instead of storing
  them. Peak memory is O(B * chunk_size * V), never O(B * S * V).

Both paths call the same per-row reduction (:func:`_topm_tail_stats`), so they agree to
float rounding of the matmul.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from lopd_jax.core.defaults import LOGITS_CHUNK, TOP_M

# Upper clamp on log(sum of top-M probs): keeps the tail bucket >= ~1e-7
# (docs/method.md, "Distillation loss").
TAIL_LOG_CLAMP = -1e-7

_UNROLL = contextvars.ContextVar("unroll_scans", default=False)


@contextlib.contextmanager
def unroll_scans():
    """Trace the sequence-chunk and micro-batch scans fully unrolled (same values).

    For FLOP counting only: ``compiled.cost_analysis()`` counts a loop body once, so the
    compile check traces its FLOP-count variants inside this context.
    """
    token = _UNROLL.set(True)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def scans_unrolled() -> bool:
    """True inside :func:`unroll_scans`."""
    return _UNROLL.get()


def _shifted_logsumexp(x: jax.Array, row_max: jax.Array) -> jax.Array:
    """log(sum(exp(x - row_max))) over the last axis; ``row_max`` is a stop-gradient max."""
    return jnp.log(jnp.sum(jnp.exp(x - row_max[..., None]), axis=-1))


def _log_tail(logp_sel: jax.Array) -> jax.Array:
    """log(1 - sum(exp(logp_sel))) computed stably: log(-expm1(min(lse, -1e-7)))."""
    lse = jax.nn.logsumexp(logp_sel, axis=-1)
    return jnp.log(-jnp.expm1(jnp.minimum(lse, TAIL_LOG_CLAMP)))


def _topm_tail_stats(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    top_m: int,
    targets: jax.Array | None = None,
    teacher_kl_logits: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Per-row top-M + tail reverse KL (and target log-probs) from fp32 logits ``[..., V]``.

    Log-probs at selected indices are formed as ``(x[i] - max) - log(sum(exp(x - max)))``,
    the same arithmetic as ``jax.nn.log_softmax``, so logit ranges of +-1e4 keep full
    precision. The teacher's top-M indices are taken on its logits: log-softmax is a
    per-row shift, so they are the top-M indices of the full-vocabulary log-softmax.
    ``teacher_kl_logits`` (same values as ``teacher_logits``) optionally feeds the KL
    alone, so its gradient path can be treated separately from the target log-prob's.
    """
    s = student_logits.astype(jnp.float32)
    t = teacher_logits.astype(jnp.float32)
    t_kl = t if teacher_kl_logits is None else teacher_kl_logits.astype(jnp.float32)
    t_top, idx = jax.lax.top_k(t_kl, top_m)  # t_top[..., 0] is the row max
    t_max = jax.lax.stop_gradient(t_top[..., 0])
    s_max = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    t_lse_kl = _shifted_logsumexp(t_kl, t_max)
    s_lse = _shifted_logsumexp(s, s_max)

    t_sel = (t_top - t_max[..., None]) - t_lse_kl[..., None]
    s_top = jnp.take_along_axis(s, jax.lax.stop_gradient(idx), axis=-1)
    s_sel = (s_top - s_max[..., None]) - s_lse[..., None]

    log_pt = jnp.concatenate([t_sel, _log_tail(t_sel)[..., None]], axis=-1)
    log_ps = jnp.concatenate([s_sel, _log_tail(s_sel)[..., None]], axis=-1)
    out = {
        "kl": jnp.sum(jnp.exp(log_ps) * (log_ps - log_pt), axis=-1),
        # Diagnostic only (a logged metric); no gradient is meant to flow through it.
        "teacher_topm_mass": jax.lax.stop_gradient(jnp.exp(jax.nn.logsumexp(t_sel, axis=-1))),
    }
    if targets is not None:
        tgt = targets[..., None]
        t_lse = t_lse_kl if teacher_kl_logits is None else _shifted_logsumexp(t, t_max)
        out["student_logp"] = jnp.take_along_axis(s, tgt, axis=-1)[..., 0] - s_max - s_lse
        out["teacher_logp"] = jnp.take_along_axis(t, tgt, axis=-1)[..., 0] - t_max - t_lse
    return out


def _check_top_m(top_m: int, vocab: int) -> None:
    if not isinstance(top_m, int) or not 1 <= top_m < vocab:
        raise ValueError(
            f"top_m={top_m!r} must be an int in [1, vocab) with vocab={vocab}; "
            "the tail bucket needs at least one token outside the top-M."
        )


def topm_tail_reverse_kl(
    student_logits: jax.Array, teacher_logits: jax.Array, top_m: int = TOP_M
) -> jax.Array:
    """Reverse KL over the teacher's top-M tokens plus one tail bucket.

    docs/method.md, "Distillation loss".

    Args:
      student_logits: ``[B, S, V]`` (any float dtype; computed in fp32).
      teacher_logits: ``[B, S, V]``, position-aligned with the student.
      top_m: number of teacher top tokens M.

    Returns:
      ``kl [B, S]`` = sum_e pS(e) (log pS(e) - log pT(e)) over the M + 1 events
      (pT[I], 1 - sum pT[I]) and (pS[I], 1 - sum pS[I]), not renormalized. Gradients flow
      into both logits arguments; the indices I carry none.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.ndim < 1:
        raise ValueError(
            f"student_logits {student_logits.shape} and teacher_logits "
            f"{teacher_logits.shape} must have the same shape [..., V]; align teacher "
            "positions to the student before calling."
        )
    _check_top_m(top_m, student_logits.shape[-1])
    return _topm_tail_stats(student_logits, teacher_logits, top_m)["kl"]


def project_logits(
    hidden: jax.Array, head: jax.Array, compute_dtype=jnp.float32, logits_dtype=jnp.float32
) -> jax.Array:
    """Logits ``hidden @ head`` with inputs in ``compute_dtype``, returned in fp32.

    ``hidden`` is ``[..., D]`` (final hidden states after the final norm), ``head`` is the
    LM-head kernel ``[D, V]`` (for tied embeddings pass the embedding table transposed).
    ``logits_dtype`` is the matmul's accumulation / output type (``preferred_element_type``):
    fp32 (default, as the release) keeps full precision from bf16 inputs; passing the
    compute dtype rounds the logits to it before the fp32 log-softmax (on bf16 that moves
    per-token log-probs by up to ~0.04, the size of the margin m).
    """
    logits = jnp.dot(hidden.astype(compute_dtype), head.astype(compute_dtype),
                     preferred_element_type=logits_dtype)
    return logits.astype(jnp.float32)


def scan_sequence_chunks(
    chunk_fn: Callable[..., dict[str, jax.Array]],
    seq_inputs: Sequence[jax.Array],
    chunk_size: int,
) -> dict[str, jax.Array]:
    """Apply ``chunk_fn`` to sequence chunks of ``seq_inputs`` under scan + remat.

    Args:
      chunk_fn: maps chunks ``[B, C, ...]`` of every array in ``seq_inputs`` (in order) to a
        dict of per-token arrays ``[B, C]``. Arrays it closes over (LM heads) are shared by
        all chunks and receive summed gradients.
      seq_inputs: arrays ``[B, S, ...]`` sharing B and S.
      chunk_size: C. S is zero-padded up to a multiple of C internally; the padding is
        stripped from the outputs, so padded positions get no gradient.

    Returns:
      dict of ``[B, S]`` arrays, one per key of ``chunk_fn``'s output.
    """
    chunks, unchunk = sequence_chunks(seq_inputs, chunk_size)
    body = jax.checkpoint(lambda xs: chunk_fn(*xs), prevent_cse=False)

    def step(carry, xs):
        return carry, body(xs)

    _, outs = jax.lax.scan(step, None, chunks, unroll=scans_unrolled())
    return {k: unchunk(v) for k, v in outs.items()}


def sequence_chunks(seq_inputs: Sequence[jax.Array], chunk_size: int):
    """``(chunks, unchunk)``: ``seq_inputs`` (``[B, S, ...]``, sharing B and S) as a tuple of
    ``[n_chunks, B, C, ...]`` arrays for ``lax.scan``, S zero-padded up to a multiple of
    ``C = min(chunk_size, S)``; ``unchunk`` maps a scan output ``[n_chunks, B, C, ...]``
    back to ``[B, S, ...]`` with the padding stripped."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int (e.g. {LOGITS_CHUNK}).")
    batch, seq = seq_inputs[0].shape[:2]
    for x in seq_inputs:
        if x.shape[:2] != (batch, seq):
            raise ValueError(
                f"all sequence inputs must share [B, S] = {(batch, seq)}, got {x.shape}; "
                "position-align teacher and student (and targets) before calling."
            )
    chunk = min(chunk_size, seq)
    n_chunks = -(-seq // chunk)
    pad = n_chunks * chunk - seq

    def to_chunks(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((batch, n_chunks, chunk) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)  # [n_chunks, B, C, ...]

    def unchunk(v):
        return jnp.moveaxis(v, 0, 1).reshape((batch, n_chunks * chunk) + v.shape[3:])[:, :seq]

    return tuple(to_chunks(x) for x in seq_inputs), unchunk


def _check_hidden_head(name: str, hidden: jax.Array, head: jax.Array) -> None:
    if hidden.ndim != 3 or head.ndim != 2 or hidden.shape[-1] != head.shape[0]:
        raise ValueError(
            f"{name}: hidden {hidden.shape} must be [B, S, D] and head {head.shape} [D, V] "
            "with matching D; pass the LM-head kernel (embedding.T for tied heads)."
        )


def check_head_inputs(name: str, hidden: jax.Array, head: jax.Array, targets: jax.Array) -> None:
    """Raise a ``ValueError`` naming the problem unless ``hidden`` is ``[B, S, D]``, ``head``
    ``[D, V]`` and ``targets`` int ``[B, S]``."""
    _check_hidden_head(name, hidden, head)
    if targets.shape != hidden.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets {targets.shape} {targets.dtype} must be int [B, S] = {hidden.shape[:2]}."
        )


@jax.custom_vjp
def _scale_grad(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Identity on ``x [B, C, V]``; the backward multiplies its cotangent by ``scale [B, C]``."""
    return x


def _scale_grad_fwd(x, scale):
    return x, scale


def _scale_grad_bwd(scale, g):
    return g * scale[..., None].astype(g.dtype), jnp.zeros_like(scale)


_scale_grad.defvjp(_scale_grad_fwd, _scale_grad_bwd)


def chunked_distill_stats(
    student_hidden: jax.Array,
    student_head: jax.Array,
    teacher_hidden: jax.Array,
    teacher_head: jax.Array,
    targets: jax.Array,
    *,
    top_m: int = TOP_M,
    chunk_size: int = LOGITS_CHUNK,
    compute_dtype=jnp.float32,
    teacher_kl_grad_scale: jax.Array | None = None,
    logits_dtype=jnp.float32,
) -> dict[str, jax.Array]:
    """Per-token distillation statistics from hidden states, chunked over the sequence.

    Args:
      student_hidden, teacher_hidden: ``[B, S, D]`` final hidden states (after the final
        norm), position-aligned by the caller.
      student_head, teacher_head: LM-head kernels ``[D, V]``; may be the same array.
      targets: ``[B, S]`` int token ids (the sampled tokens).
      top_m: teacher top-M for the KL.
      chunk_size: sequence positions per chunk. One chunk holds B * chunk_size rows of
        V logits, so with a larger per-device batch pick a smaller chunk_size.
      compute_dtype: dtype of the logits matmul's inputs (log-softmax is always fp32).
      logits_dtype: the matmul's accumulation / output dtype (see :func:`project_logits`).
      teacher_kl_grad_scale: optional ``[B, S]`` per-token factor applied only to the
        gradient that the KL sends into the teacher's logits (values unchanged, and the
        teacher's target log-prob gradient is unscaled). ``lopd_objective`` uses it to give
        the composer a different KL weighting than the student in one pass.

    Returns:
      dict of ``[B, S]`` fp32 arrays: ``kl`` (top-M + tail reverse KL), ``student_logp``
      (log pi_S(target)), ``teacher_logp`` (log pi_T(target)), ``teacher_topm_mass`` (sum
      of the teacher's top-M probabilities, stop-gradient). Gradients flow to both hidden
      states and both heads.
    """
    _check_hidden_head("student", student_hidden, student_head)
    _check_hidden_head("teacher", teacher_hidden, teacher_head)
    if student_head.shape[1] != teacher_head.shape[1]:
        raise ValueError(
            f"student vocab {student_head.shape[1]} != teacher vocab "
            f"{teacher_head.shape[1]}; teacher and student must share one tokenizer."
        )
    if targets.shape != student_hidden.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets {targets.shape} {targets.dtype} must be int [B, S] = "
            f"{student_hidden.shape[:2]}."
        )
    _check_top_m(top_m, student_head.shape[1])
    s_head = student_head.astype(compute_dtype)
    t_head = teacher_head.astype(compute_dtype)
    seq_inputs = [student_hidden, teacher_hidden, targets]
    if teacher_kl_grad_scale is not None:
        if teacher_kl_grad_scale.shape != targets.shape:
            raise ValueError(
                f"teacher_kl_grad_scale {teacher_kl_grad_scale.shape} must be [B, S] = "
                f"{targets.shape}."
            )
        seq_inputs.append(jax.lax.stop_gradient(teacher_kl_grad_scale.astype(jnp.float32)))

    def chunk_fn(s_h, t_h, tgt, *scale):
        s_logits = project_logits(s_h, s_head, compute_dtype, logits_dtype)
        t_logits = project_logits(t_h, t_head, compute_dtype, logits_dtype)
        t_kl = _scale_grad(t_logits, scale[0]) if scale else None
        return _topm_tail_stats(s_logits, t_logits, top_m, tgt, t_kl)

    return scan_sequence_chunks(chunk_fn, seq_inputs, chunk_size)


def chunked_token_logp(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = LOGITS_CHUNK,
    compute_dtype=jnp.float32,
    logits_dtype=jnp.float32,
) -> jax.Array:
    """log pi(target) per position, ``[B, S]`` fp32, chunked like :func:`chunked_distill_stats`.

    Used by the cold start (NLL), GRPO (PPO ratios) and the sampler check.
    """
    check_head_inputs("token_logp", hidden, head, targets)
    w = head.astype(compute_dtype)

    def chunk_fn(h, tgt):
        logits = project_logits(h, w, compute_dtype, logits_dtype)
        row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        lse = _shifted_logsumexp(logits, row_max)
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        return {"logp": picked - row_max - lse}

    return scan_sequence_chunks(chunk_fn, [hidden, targets], chunk_size)["logp"]
