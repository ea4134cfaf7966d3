"""Paged KV cache attention: a page pool per layer, per-row page tables, ragged rows.

The layout is the one JAX's TPU kernel ``ragged_paged_attention`` reads, so one pool serves
both paths: ``kv_pages`` [num_pages, page_size, 2 * KV, hd] (keys and values interleaved
per KV head), ``page_table`` [B, pages_per_row] (row ``b``'s position ``p`` lives in page
``page_table[b, p // page_size]``) and ``kv_lens`` [B]. Queries are row-padded with their
positions; the mask is the decoder's (causal, length, optional window). One call serves
decode, prefill and mixed rows.

:func:`paged_attention` is the pure-JAX path: it gathers each row's first ``num_pages``
pages (a static bound set to the longest live row) and runs plain attention.
:func:`ragged_kernel_attention` calls the Pallas kernel on the same pool. :func:`attend`
writes a layer's new keys and values and attends on the backend :func:`resolve_backend`
picks (the kernel on TPU when head_dim is a multiple of 128, else XLA), per shard under
``shard_map`` with a mesh; page ids stay global (docs/engine.md, "TPU kernels").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import Mesh, PartitionSpec as P

from models.attention import plain_attention

__all__ = ["BACKENDS", "KERNEL_HEAD_DIM", "attend", "combine_kv", "gather_kv", "kernel_blocks", "paged_attention",
           "ragged_kernel_attention", "resolve_backend", "write_kv"]

BACKENDS = ("auto", "xla", "kernel")


def combine_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[..., KV, hd] keys and values -> [..., 2 * KV, hd] interleaved (key ``2h``, value ``2h + 1``)."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, page_table: jax.Array, positions: jax.Array,
             valid: jax.Array) -> jax.Array:
    """Write keys / values [B, S, KV, hd] at ``positions`` [B, S] of each row's pages.

    Entries with ``valid`` False are dropped (never written)."""
    P, ps = kv_pages.shape[:2]
    slot = jnp.clip(positions // ps, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, slot, axis=1)
    page = jnp.where(valid, page, P)  # out of range: dropped
    kv = combine_kv(k, v).astype(kv_pages.dtype)
    return kv_pages.at[page, positions % ps].set(kv, mode="drop")


def gather_kv(kv_pages: jax.Array, page_table: jax.Array, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """Dense keys and values [B, num_pages * page_size, KV, hd] of each row's first
    ``num_pages`` pages."""
    P, ps, KV2, hd = kv_pages.shape
    B = page_table.shape[0]
    kv = jnp.take(kv_pages, page_table[:, :num_pages], axis=0).reshape(B, num_pages * ps, KV2, hd)
    return kv[:, :, 0::2], kv[:, :, 1::2]


def paged_attention(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                    q_pos: jax.Array, window, scale: float, num_pages: int | None = None) -> jax.Array:
    """Pure-JAX attention over the page pool (see the module docstring).

    Args:
      q: [B, S, KV, G, hd] queries (row-padded; padded queries get a finite, unused output).
      kv_pages / page_table / kv_lens: the pool, the rows' page tables and cache lengths.
      q_pos: [B, S] query positions.
      window: sliding window (0 = none; may be traced).
      scale: softmax scale.
      num_pages: static number of leading pages per row to read (default: the whole table).

    Returns:
      [B, S, KV, G, hd].
    """
    n = page_table.shape[1] if num_pages is None else int(num_pages)
    k, v = gather_kv(kv_pages, page_table, n)
    T = k.shape[1]
    k_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (q.shape[0], T))
    k_valid = k_pos < kv_lens[:, None]
    return plain_attention(q, k.astype(q.dtype), v.astype(q.dtype), q_pos, k_pos, k_valid, window, scale)


def ragged_kernel_attention(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                            q_lens: jax.Array, window: int, scale: float, kernel=None, **kernel_kw) -> jax.Array:
    """JAX's TPU kernel ``ragged_paged_attention`` on the same pool.

    Rows' queries are the last ``q_lens[b]`` tokens of each row (positions
    ``kv_lens[b] - q_lens[b] ..``), given row-padded as ``q`` [B, S, KV, G, hd]; they are
    packed for the kernel and unpacked after (padded query slots come back as zeros).
    ``window`` is static (0 = none). Extra keyword arguments go to the kernel (block sizes,
    ``vmem_limit_bytes``; give both block sizes when compiling ahead of time without a TPU:
    the kernel otherwise looks up tuned sizes for the local chip). ``kernel`` replaces the
    kernel by a function of the same signature (e.g. its reference implementation
    ``ref_ragged_paged_attention``). Returns [B, S, KV, G, hd].
    """
    kernel = ragged_paged_attention if kernel is None else kernel
    B, S, KV, G, hd = q.shape
    flat = q.reshape(B * S, KV * G, hd)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens.astype(jnp.int32))])
    j = jnp.arange(B * S, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(starts, j, side="right") - 1, 0, B - 1)
    off = j - starts[row]
    src = jnp.where(off < q_lens[row], row * S + off, 0)
    packed = jnp.take(flat, src, axis=0)
    out = kernel(packed, kv_pages, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32), starts,
                 jnp.asarray([B], jnp.int32), sm_scale=scale, sliding_window=int(window) or None, **kernel_kw)
    # back to row-padded [B, S, ...]
    b = jnp.arange(B)[:, None]
    s = jnp.arange(S)[None]
    idx = jnp.clip(starts[b] + s, 0, B * S - 1)
    res = jnp.take(out, idx.reshape(-1), axis=0).reshape(B, S, KV, G, hd)
    return jnp.where((s < q_lens[:, None])[..., None, None, None], res, 0).astype(q.dtype)


KERNEL_HEAD_DIM = 128  # the ragged kernel's softmax scratch is 128 lanes wide: head_dim a multiple of it


def resolve_backend(backend: str, mesh: Mesh | None = None, head_dim: int | None = None) -> str:
    """``"xla"`` or ``"kernel"``: ``"auto"`` is the kernel on TPU devices (the mesh's, or
    the default backend without a mesh; an AOT topology's devices are TPU) when
    ``head_dim`` is a multiple of 128 (the kernel's requirement), else XLA."""
    if backend not in BACKENDS:
        raise ValueError(f"paged attention backend {backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    fits = head_dim is None or head_dim % KERNEL_HEAD_DIM == 0
    return "kernel" if platform == "tpu" and fits else "xla"


def kernel_blocks(num_pages: int, num_queries: int, pages_per_block: int = 8,
                  queries_per_block: int = 32) -> dict:
    """Block sizes for the ragged kernel, capped by the call's shapes (the kernel requires
    ``num_kv_pages_per_block <= pages per row``). Given explicitly because without a local
    TPU (AOT compiles) the kernel cannot look up its tuned sizes."""
    return {"num_kv_pages_per_block": max(1, min(pages_per_block, num_pages)),
            "num_queries_per_block": max(1, min(queries_per_block, num_queries))}


def _flat(pool: jax.Array, page_table: jax.Array, layer):
    """A stacked pool [L, P, ...] seen as one pool of L * P pages, the table shifted to
    ``layer``'s pages (a reshape of leading axes: no copy). ``layer`` None: unchanged."""
    if layer is None:
        return pool, page_table
    L, P = pool.shape[:2]
    return pool.reshape(L * P, *pool.shape[2:]), page_table + layer * P


def _kernel_shard(k, v, q, pool, page_table, positions, valid, kv_lens, sel, *, windows, scale, num_pages,
                  kernel, data_axis, stacked):
    """Write + ragged kernel on one shard's rows, pages and KV heads (global page ids in).
    ``stacked``: ``pool`` holds every layer and ``sel`` = (layer, index of its window in
    ``windows``: one static kernel call per window, chosen by ``lax.switch``); otherwise
    one layer's pool and ``windows`` has its one window."""
    if data_axis is not None:
        page_table = page_table - jax.lax.axis_index(data_axis) * pool.shape[1 if stacked else 0]
    shape = pool.shape
    flat, table = _flat(pool, page_table, sel[0] if stacked else None)
    flat = write_kv(flat, k, v, table, positions, valid)
    table = table[:, :num_pages]
    q_lens = valid.sum(axis=1).astype(jnp.int32)
    blocks = kernel_blocks(num_pages, q.shape[0] * q.shape[1]) if kernel is None else {}  # a stand-in has none
    calls = [functools.partial(ragged_kernel_attention, window=w, scale=scale, kernel=kernel, **blocks)
             for w, _ in windows]
    args = (q, flat, table, kv_lens, q_lens)
    if not stacked:
        out = calls[0](*args)
    else:
        out = jax.lax.switch(sel[1], [lambda a, c=c: c(*a) for c in calls], args)
    return out, flat.reshape(shape)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, page_table: jax.Array, positions: jax.Array,
           valid: jax.Array, kv_lens: jax.Array, window, scale: float, num_pages: int, *,
           backend: str = "auto", mesh: Mesh | None = None, kernel=None, layer=None,
           windows: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """Write one layer's new keys / values and attend over the pool; the backend switch.

    Args:
      q: [B, S, KV, G, hd] queries at ``positions`` [B, S]; k / v: [B, S, KV, hd].
      pool / page_table: the layer's page pool and the rows' (global) page ids; with
        ``layer``, the stacked pools of every layer [L, P, page_size, 2 * KV, hd].
      valid: [B, S] real tokens; on the kernel path they must be a prefix of each row and
        the row's last tokens (``positions`` ending at ``kv_lens - 1``), as the engine feeds.
      kv_lens: [B] tokens in each row's cache after this write.
      window: sliding window (0 = none): static, or traced with ``layer``.
      scale: softmax scale.
      num_pages: static count of leading table pages attention reads.
      backend: ``"auto"`` / ``"xla"`` / ``"kernel"`` (:func:`resolve_backend`).
      mesh: the inference mesh (``data`` / ``tensor`` axes) for the kernel's ``shard_map``.
      kernel: a stand-in for the TPU kernel with its signature (tests pass its reference).
      layer: traced layer index into a stacked pool (a scan over layers), or None.
      windows: with ``layer``, every window a layer may have (the kernel's is static: one
        kernel call per value, ``lax.switch`` on ``window``'s place among them).

    Returns:
      ``(out [B, S, KV, G, hd], new pool)``.
    """
    hd = q.shape[-1]
    if resolve_backend(backend, mesh, hd) == "xla":
        shape = pool.shape
        flat, table = _flat(pool, page_table, layer)
        flat = write_kv(flat, k, v, table, positions, valid)
        out = paged_attention(q, flat, table, kv_lens, positions, window, scale, num_pages)
        return out, flat.reshape(shape)
    if kernel is None and hd % KERNEL_HEAD_DIM:
        raise ValueError(f"the TPU kernel ragged_paged_attention needs head_dim a multiple of {KERNEL_HEAD_DIM} "
                         f"(its softmax scratch is {KERNEL_HEAD_DIM} lanes wide), got {hd}; use backend='xla' "
                         "or 'auto'")
    if layer is None:
        wins, sel = ((int(window), 0),), jnp.zeros(2, jnp.int32)
    else:
        wins = tuple((int(w), i) for i, w in enumerate(windows))
        sel = jnp.stack([jnp.asarray(layer, jnp.int32),
                         jnp.argmax(jnp.asarray([w for w, _ in wins]) == window).astype(jnp.int32)])
    fn = functools.partial(_kernel_shard, windows=wins, scale=scale, num_pages=int(num_pages), kernel=kernel,
                           data_axis=None, stacked=layer is not None)
    if mesh is None:
        return fn(k, v, q, pool, page_table, positions, valid, kv_lens, sel)
    data = "data" if mesh.shape.get("data", 1) > 1 else None
    tensor = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    rows = P(data)
    heads4 = P(data, None, tensor, None)
    pool_spec = P(data, None, tensor, None) if layer is None else P(None, data, None, tensor, None)
    fn = functools.partial(fn.func, **{**fn.keywords, "data_axis": data})
    return jax.shard_map(fn, mesh=mesh, check_vma=False,
                         in_specs=(heads4, heads4, P(data, None, tensor, None, None), pool_spec,
                                   rows, rows, rows, rows, P()),
                         out_specs=(P(data, None, tensor, None, None), pool_spec))(
        k, v, q, pool, page_table, positions, valid, kv_lens, sel)
