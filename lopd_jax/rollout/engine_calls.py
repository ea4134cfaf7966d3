"""The engine's two device calls (:mod:`lopd_jax.rollout.engine`): prefill and a K-step decode chunk.

Both are jitted once per static setting (sampling mode, LoRA, decode chunk, stop ids) and
per page-table width, run the decoder over the paged pools
(:func:`lopd_jax.rollout.paged_step.paged_forward`, or a test policy's own ``paged_forward``) and
sample each row with its own key: the token at context position ``p`` of episode ``e``
uses ``fold_in(fold_in(rng, e), p)``, so a row's draws never depend on the other rows.

``mesh`` (static): the engine's inference mesh (:mod:`lopd_jax.rollout.layout`); the
attention backend then runs per shard (:func:`lopd_jax.rollout.layout.attention_mesh`) and
the pools keep their layout (:func:`lopd_jax.rollout.layout.pool_sharding`) from call to call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.layer import layer_weights
from lopd_jax.rollout.layout import attention_mesh, pool_sharding
from lopd_jax.rollout.paged_step import paged_forward
from lopd_jax.rollout.sampling import sample_logits

__all__ = ["decode", "prefill"]


def _sample_rows(logits, keys, temperature, top_p, top_k: int, greedy: bool):
    """Per-row keys: row ``b`` samples with ``keys[b]`` alone (batch-independent draws)."""
    if greedy:
        return sample_logits(logits, keys[0], temperature, top_p, top_k, greedy=True)
    one = lambda l, k: tuple(x[0] for x in sample_logits(l[None], k, temperature, top_p, top_k, greedy=False))
    return jax.vmap(one)(logits, keys)


def _keys(rng, eids, pos):
    return jax.vmap(lambda e, p: jax.random.fold_in(jax.random.fold_in(rng, e), p))(eids, pos)


def _forward(model, lora: bool, mesh=None):
    """``f(ids, positions, valid, kv_lens, pools, page_table, num_pages, inputs_embeds)``
    -> (hidden, pools): the model's own ``paged_forward`` if it defines one (a test
    policy), else the decoder's (:func:`lopd_jax.rollout.paged_step.paged_forward`) on ``mesh``."""
    own = getattr(model, "paged_forward", None)
    if own is not None:
        return own
    layers = layer_weights(model, lora)
    attn = None if mesh is None else attention_mesh(mesh)
    pinned = (lambda pools: pools) if mesh is None else (
        lambda pools: tuple(jax.lax.with_sharding_constraint(p, pool_sharding(mesh)) for p in pools))

    def forward(ids, pos, valid, kv_lens, pools, table, n, emb=None):
        h, pools = paged_forward(model, layers, ids, pos, valid, kv_lens, pinned(pools), table, n, lora, emb,
                                 mesh=attn)
        return h, pinned(pools)
    return forward


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("mesh",), donate_argnums=(5,))
def prefill(graphdef, top_k: int, greedy: bool, lora: bool, params, pools, ids, start, n, page_table, eids, rng,
             temperature, top_p, vectors=None, use_vec=None, *, mesh=None):
    """Feed ``ids[b, :n[b]]`` at positions ``start[b]..``; sample each row's next token.
    Attention reads the ``page_table.shape[1]`` leading pages of each row. With
    ``vectors`` [B, C, D], positions where ``use_vec`` [B, C] is set take those input
    embeddings instead of their ids'."""
    model = nnx.merge(graphdef, params)
    num_pages = page_table.shape[1]
    C = ids.shape[1]
    pos = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    valid = jnp.arange(C)[None] < n[:, None]
    emb = None
    if vectors is not None:
        base = model.embed_tokens(ids)
        emb = jnp.where(use_vec[..., None], vectors.astype(base.dtype), base)
    h, pools = _forward(model, lora, mesh)(ids, pos, valid, start + n, pools, page_table, num_pages, emb)
    last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    logits = jnp.dot(last, model.lm_head_kernel().astype(jnp.float32))
    tok, lp, raw = _sample_rows(logits, _keys(rng, eids, start + n), temperature, top_p, top_k, greedy)
    return (tok, lp, raw), pools


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), static_argnames=("mesh",), donate_argnums=(7,))
def decode(graphdef, steps: int, top_k: int, greedy: bool, lora: bool, stop_ids: tuple, params, pools, prev,
            lengths, live, remaining, page_table, eids, rng, temperature, top_p, *, mesh=None):
    """``steps`` decode steps for every slot; a row stops at a stop id or after ``remaining``.
    Attention reads the ``page_table.shape[1]`` leading pages of each row."""
    model = nnx.merge(graphdef, params)
    num_pages = page_table.shape[1]
    forward = _forward(model, lora, mesh)
    head = model.lm_head_kernel().astype(jnp.float32)
    stops = jnp.asarray(stop_ids, jnp.int32)

    def body(carry, _):
        pools, prev, lengths, live, n_gen = carry
        h, pools = forward(prev[:, None], lengths[:, None], live[:, None], lengths + live, pools, page_table,
                           num_pages)
        logits = jnp.dot(h[:, 0].astype(jnp.float32), head)
        tok, lp, raw = _sample_rows(logits, _keys(rng, eids, lengths + 1), temperature, top_p, top_k, greedy)
        lengths = lengths + live
        n_gen = n_gen + live
        out = (jnp.where(live, tok, -1), lp, raw)
        done = jnp.isin(tok, stops) | (n_gen >= remaining)
        return (pools, jnp.where(live, tok, prev), lengths, live & ~done, n_gen), out

    init = (pools, prev, lengths, live, jnp.zeros_like(lengths))
    (pools, _, _, _, n_gen), (toks, lps, raws) = jax.lax.scan(body, init, None, length=steps)
    return (toks.T, lps.T, raws.T, n_gen), pools
