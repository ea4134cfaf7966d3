"""Token sampling from logits: temperature, top-k, top-p (Hugging Face's warper order).

:func:`sample_logits` returns the sampled ids with two log-probs: the log-softmax of the
processed distribution actually sampled from, and the model's raw temperature-1 log-prob.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (SPEC 2.2 defaults). ``temperature == 0`` is greedy; ``top_k = 0``
    and ``top_p = 1`` disable those filters."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k}")


def _filtered(vals: jax.Array, temperature, top_p) -> jax.Array:
    """Temperature then top-p over candidates sorted by descending logit -> log-probs."""
    temperature = jnp.asarray(temperature, jnp.float32)
    t = jnp.where(temperature <= 0, 1.0, temperature)
    scaled = vals / t.reshape(t.shape + (1,))  # scalar or per-row [B]
    probs = jax.nn.softmax(scaled, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    top_p = jnp.asarray(top_p, jnp.float32)
    keep = (mass_before < top_p.reshape(top_p.shape + (1,))) | (jnp.arange(vals.shape[-1]) == 0)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def processed_logprobs(logits: jax.Array, temperature, top_p, top_k: int):
    """The distribution :func:`sample_logits` samples from, over candidate ids.

    Temperature, then top-k, then top-p on the top-k-filtered distribution (Hugging Face's
    warper order): a candidate is kept when the probability mass of the candidates ranked
    above it is below ``top_p`` (the first always stays). Greedy rows
    (``temperature <= 0``) are scaled by 1 here. Returns ``(log-probs [B, k] with -inf on
    dropped candidates, their token ids [B, k])``. With ``top_k > 0`` candidates are sorted
    by descending logit (ties: lower id first); ``top_k = 0`` keeps the whole vocabulary and
    sorts it only when some ``top_p < 1`` (a full sort is slow on CPU).
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
        return _filtered(logits, temperature, 1.0), idx

    return jax.lax.cond(jnp.all(jnp.asarray(top_p) >= 1.0), unsorted, full_sort, None)


def sample_logits(logits: jax.Array, key: jax.Array, temperature, top_p, top_k: int):
    """Sample one token per row of ``logits`` [B, V] from :func:`processed_logprobs`.

    Greedy where ``temperature <= 0`` (``argmax``: the first maximal id).
    Returns ``(tokens [B] int32, processed log-prob [B], raw temperature-1 log-prob [B])``;
    the processed log-prob is 0 for greedy rows (a point mass).
    """
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    processed, idx = processed_logprobs(logits, temperature, top_p, top_k)
    greedy = jnp.asarray(temperature, jnp.float32) <= 0
    choice = jax.random.categorical(key, processed, axis=-1)
    sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    lp = jnp.where(greedy, 0.0, jnp.take_along_axis(processed, choice[:, None], axis=-1)[:, 0])
    raw_lp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return tokens, lp, raw_lp
