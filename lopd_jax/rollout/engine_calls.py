"""The engine's two device calls (:mod:`lopd_jax.rollout.engine`): prefill and a K-step decode chunk.

Each takes the engine's fixed settings (:class:`Program`, static), its device state (params,
page pools), one call's rows (:class:`PrefillRows` / :class:`DecodeRows`), the
:class:`lopd_jax.settings.sections.SamplingParams` (a pytree: ``top_k`` and greedy static,
temperature and top-p traced) and the key. They compile once per static setting and per
page-table width, run the decoder over the paged pools
(:func:`lopd_jax.rollout.paged_step.paged_forward`, or a test policy's own ``paged_forward``) and
sample each row with its own key: the token at context position ``p`` of episode ``e``
uses ``fold_in(fold_in(rng, e), p)`` (``rng``: the call's key, or the row's own base key when
the rows carry ``keys``, as a stream of steps does), so a row's draws never depend on the
other rows. With
a mesh (:mod:`lopd_jax.rollout.layout`) attention runs per shard and the pools keep their
layout from call to call.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layer import layer_weights
from lopd_jax.rollout.engine_rows import DecodeRows, PrefillRows
from lopd_jax.rollout.layout import attention_mesh, pool_sharding
from lopd_jax.rollout.paged_step import paged_forward
from lopd_jax.rollout.sampling import sample_logits
from lopd_jax.settings.sections import SamplingParams

__all__ = ["DecodeRows", "PrefillRows", "Program", "decode", "key_data", "prefill"]


class Program(NamedTuple):
    """What stays fixed over an engine's device calls (static: hashed into the compile key):
    the model's graph, whether its LoRA is on, the inference mesh (None: one device), and
    for :func:`decode` the end-of-turn ids and decode steps per call."""

    graphdef: Any
    lora: bool
    mesh: Any = None
    stop_ids: tuple = ()
    decode_steps: int = 0

    def model_part(self) -> "Program":
        """This program without the decode-only settings: what :func:`prefill` takes, so its
        compiled variants do not depend on them."""
        return self._replace(stop_ids=(), decode_steps=0)


def key_data(rng) -> np.ndarray:
    """Host copy of a PRNG key's data (a typed key's ``key_data``, a raw key as it is): how a
    run's or an episode's base key travels in the rows' ``keys``."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return np.asarray(rng)


def _sample_rows(logits, keys, sp: SamplingParams):
    """Per-row keys: row ``b`` samples with ``keys[b]`` alone (batch-independent draws)."""
    if sp.greedy:
        return sample_logits(logits, keys[0], sp.temperature, sp.top_p, sp.top_k, greedy=True)
    one = lambda l, k: tuple(x[0] for x in sample_logits(l[None], k, sp.temperature, sp.top_p, sp.top_k,
                                                         greedy=False))
    return jax.vmap(one)(logits, keys)


def _keys(rng, eids, pos, row_keys=None):
    """Row ``b``'s key at position ``pos[b]``: ``fold_in(fold_in(base, eids[b]), pos[b])``, the
    base being ``rng`` or, with ``row_keys``, the row's own key data (in ``rng``'s key kind)."""
    if row_keys is None:
        return jax.vmap(lambda e, p: jax.random.fold_in(jax.random.fold_in(rng, e), p))(eids, pos)
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        row_keys = jax.random.wrap_key_data(row_keys, impl=jax.random.key_impl(rng))
    return jax.vmap(lambda k, e, p: jax.random.fold_in(jax.random.fold_in(k, e), p))(row_keys, eids, pos)


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


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill(prog: Program, params, pools, rows: PrefillRows, sampling: SamplingParams, rng):
    """Feed ``rows.ids[b, :n[b]]`` at positions ``start[b]..``; sample each row's next token.
    ``prog`` is :meth:`Program.model_part`. Returns ``((tokens, log-probs, raw log-probs), pools)``."""
    model = nnx.merge(prog.graphdef, params)
    ids, start, n, table = rows.ids, rows.start, rows.n, rows.page_table
    C = ids.shape[1]
    pos = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    valid = jnp.arange(C)[None] < n[:, None]
    emb = None
    if rows.vectors is not None:
        base = model.embed_tokens(ids)
        emb = jnp.where(rows.use_vec[..., None], rows.vectors.astype(base.dtype), base)
    h, pools = _forward(model, prog.lora, prog.mesh)(ids, pos, valid, start + n, pools, table, table.shape[1], emb)
    last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    logits = jnp.dot(last, model.lm_head_kernel().astype(jnp.float32))
    tok, lp, raw = _sample_rows(logits, _keys(rng, rows.eids, start + n, rows.keys), sampling)
    return (tok, lp, raw), pools


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def decode(prog: Program, params, pools, rows: DecodeRows, sampling: SamplingParams, rng):
    """``prog.decode_steps`` decode steps for every row; a row stops at a stop id or after
    ``remaining``. Returns ``((tokens, log-probs, raw log-probs) [B, steps], generated [B]),
    pools)``."""
    model = nnx.merge(prog.graphdef, params)
    table = rows.page_table
    forward = _forward(model, prog.lora, prog.mesh)
    head = model.lm_head_kernel().astype(jnp.float32)
    stops = jnp.asarray(prog.stop_ids, jnp.int32)

    def body(carry, _):
        pools, prev, lengths, live, n_gen = carry
        h, pools = forward(prev[:, None], lengths[:, None], live[:, None], lengths + live, pools, table,
                           table.shape[1])
        logits = jnp.dot(h[:, 0].astype(jnp.float32), head)
        tok, lp, raw = _sample_rows(logits, _keys(rng, rows.eids, lengths + 1, rows.keys), sampling)
        lengths = lengths + live
        n_gen = n_gen + live
        out = (jnp.where(live, tok, -1), lp, raw)
        done = jnp.isin(tok, stops) | (n_gen >= rows.remaining)
        return (pools, jnp.where(live, tok, prev), lengths, live & ~done, n_gen), out

    init = (pools, rows.prev, rows.lengths, rows.live, jnp.zeros_like(rows.lengths))
    (pools, _, _, _, n_gen), (toks, lps, raws) = jax.lax.scan(body, init, None, length=prog.decode_steps)
    return (toks.T, lps.T, raws.T, n_gen), pools
