"""Token sampling from logits: temperature, top-k, top-p (Hugging Face's warper order).

:func:`sample_logits` returns the sampled ids with two log-probs: the log-softmax of the
processed distribution actually sampled from, and the model's raw temperature-1 log-prob.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _scaled(vals: jax.Array, temperature) -> jax.Array:
    """``vals / temperature`` (scalar or per-row [B]); greedy rows (``t <= 0``) scaled by 1."""
    temperature = jnp.asarray(temperature, jnp.float32)
    t = jnp.where(temperature <= 0, 1.0, temperature)
    return vals / t.reshape(t.shape + (1,))


def _top_p_keep(probs: jax.Array, top_p) -> jax.Array:
    """Keep a candidate (sorted by descending probability) when the mass ranked above it is
    below ``top_p``; the first always stays."""
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    top_p = jnp.asarray(top_p, jnp.float32)
    return (mass_before < top_p.reshape(top_p.shape + (1,))) | (jnp.arange(probs.shape[-1]) == 0)


def _filtered(vals: jax.Array, temperature, top_p) -> jax.Array:
    """Temperature then top-p over candidates sorted by descending logit -> log-probs."""
    scaled = _scaled(vals, temperature)
    keep = _top_p_keep(jax.nn.softmax(scaled, axis=-1), top_p)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def processed_logprobs(logits: jax.Array, temperature, top_p, top_k: int):
    """The distribution :func:`sample_logits` samples from, over candidate ids.

    Temperature, then top-k, then top-p on the top-k-filtered distribution (Hugging Face's
    warper order): a candidate is kept when the probability mass of the candidates ranked
    above it is below ``top_p`` (the first always stays). Greedy rows
    (``temperature <= 0``) are scaled by 1 here. Returns ``(log-probs [B, k] with -inf on
    dropped candidates, their token ids [B, k])``. With ``top_k > 0`` candidates are sorted
    by descending logit (ties: lower id first); ``top_k = 0`` keeps the whole vocabulary and
    sorts it only when some ``top_p < 1`` (a full sort is slow on CPU; :func:`sample_logits`
    avoids it when few candidates hold the top-p mass).
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    if 0 < top_k < V:
        vals, idx = jax.lax.top_k(logits, top_k)
        return _filtered(vals, temperature, top_p), idx

    def full_sort(_):
        vals, idx = jax.lax.top_k(logits, V)
        return _filtered(vals, temperature, top_p), idx

    def unsorted(_):
        idx = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), logits.shape)
        return jax.nn.log_softmax(_scaled(logits, temperature), axis=-1), idx

    return jax.lax.cond(jnp.all(jnp.asarray(top_p) >= 1.0), unsorted, full_sort, None)


#: With ``top_k = 0`` and ``top_p < 1``, :func:`sample_logits` first tries the top this-many
#: candidates and sorts the whole vocabulary only when they hold less than ``top_p``.
TOP_P_CANDIDATES = 64


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The first maximal id per row (``jnp.argmax`` semantics for finite logits), as a
    max and a masked min: two plain reductions, cheaper on CPU than argmax's
    value-and-index reduction."""
    V = logits.shape[-1]
    hit = logits == jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.where(first < V, first, jnp.argmax(logits, axis=-1)).astype(jnp.int32)  # NaN rows: argmax


def _sample_top_p_only(logits, key, temperature, top_p):
    """``top_k = 0``, ``top_p < 1``: the kept set is exactly a prefix of the sorted
    vocabulary, so when the top ``TOP_P_CANDIDATES`` hold at least ``top_p`` of the
    (full-vocabulary) mass, sampling among them is the same distribution as after a full
    sort. Otherwise sort everything. Returns (choice log-probs [B, k], ids [B, k])."""
    V = logits.shape[-1]
    K = min(TOP_P_CANDIDATES, V)
    vals, idx = jax.lax.top_k(logits, K)
    scaled = _scaled(vals, temperature)
    full = _scaled(logits, temperature)
    m = jnp.max(full, axis=-1, keepdims=True)
    denom = jnp.sum(jnp.exp(full - m), axis=-1, keepdims=True)
    probs = jnp.exp(scaled - m) / denom  # full-vocabulary probabilities of the candidates
    covered = jnp.all(jnp.sum(probs, axis=-1) >= jnp.asarray(top_p, jnp.float32))

    def few(_):
        keep = _top_p_keep(probs, top_p)
        lp = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
        choice = jax.random.categorical(key, lp, axis=-1)
        return (jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0],
                jnp.take_along_axis(lp, choice[:, None], axis=-1)[:, 0])

    def everything(_):
        lp, ids = processed_logprobs(logits, temperature, top_p, 0)
        choice = jax.random.categorical(key, lp, axis=-1)
        return (jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0],
                jnp.take_along_axis(lp, choice[:, None], axis=-1)[:, 0])

    return jax.lax.cond(covered, few, everything, None)


def sample_logits(logits: jax.Array, key: jax.Array, temperature, top_p, top_k: int, greedy: bool | None = None):
    """Sample one token per row of ``logits`` [B, V] from :func:`processed_logprobs`.

    Greedy where ``temperature <= 0`` (the first maximal id). ``greedy`` (static) skips
    the unused branch: ``True`` treats every row as greedy, ``False`` none (then
    ``temperature`` must be > 0), ``None`` decides per row at run time.
    Returns ``(tokens [B] int32, processed log-prob [B], raw temperature-1 log-prob [B])``;
    the processed log-prob is 0 for greedy rows (a point mass).
    """
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    if greedy is True:
        tokens = greedy_tokens(logits)
        return tokens, jnp.zeros(tokens.shape, jnp.float32), jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    V = logits.shape[-1]
    if top_k == 0 or top_k >= V:
        def sort_free(_):
            lp = jax.nn.log_softmax(_scaled(logits, temperature), axis=-1)  # candidates = all ids
            choice = jax.random.categorical(key, lp, axis=-1)
            return choice.astype(jnp.int32), jnp.take_along_axis(lp, choice[:, None], axis=-1)[:, 0]

        sampled, lp = jax.lax.cond(jnp.all(jnp.asarray(top_p) >= 1.0), sort_free,
                                   lambda _: _sample_top_p_only(logits, key, temperature, top_p), None)
    else:
        processed, idx = processed_logprobs(logits, temperature, top_p, top_k)
        choice = jax.random.categorical(key, processed, axis=-1)
        sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
        lp = jnp.take_along_axis(processed, choice[:, None], axis=-1)[:, 0]
    sampled = sampled.astype(jnp.int32)
    if greedy is False:
        tokens = sampled
    else:
        is_greedy = jnp.asarray(temperature, jnp.float32) <= 0
        tokens = jnp.where(is_greedy, greedy_tokens(logits), sampled)
        lp = jnp.where(is_greedy, 0.0, lp)
    raw_lp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return tokens, lp, raw_lp

