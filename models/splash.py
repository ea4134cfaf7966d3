"""Pallas splash attention (TPU) behind the decoder's attention interface.

The splash kernel is a Mosaic kernel XLA cannot auto-partition, so on a mesh it runs under
``jax.shard_map`` (batch over the batch axes, KV heads over ``tensor`` when they divide),
one kernel call per local sequence. Its masks are static and index-based, the decoder's
position-based (:mod:`models.attention`); they agree when every row's positions are
``0 .. S-1`` (or restart at 0 in each segment of a packed row), as in all training
forwards. Causal and sliding-window layers pick their mask with ``lax.switch`` on the
per-layer window; padding is segment id 0, so a valid query sees exactly the valid keys of
its own segment that the reference allows. The sequence is padded internally to a
multiple of the block size and q is pre-scaled. The kernel does not run on CPU;
``interpret=True`` runs the Pallas interpreter there (tests only).

**Blocks across segments are skipped.** The kernel's static mask knows causality and the
window, not the segments, so on its own it computes (and masks) every causal block of a
packed row. Each row's mask infos are therefore narrowed at run time
(:func:`segment_block_keep`, :func:`restrict_mask_info`): a (query block, key block) pair
runs only if the two blocks' ranges of real segment ids overlap, or it is a diagonal
block (so a query block of padding still sees a key and stays finite). The skipped blocks
are exactly those with no allowed pair for a real query, so real positions are unchanged;
a padding query sees only the padding of its own block. Skipped grid steps also keep the
previous block's index, so they fetch nothing new. A packed row then costs about its
segments' causal attention, plus a block's width per segment at the boundaries.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.partitioning import Rules

_INTERPRET = [False]


@contextlib.contextmanager
def interpret_on_cpu():
    """Within this context, splash attention traced for a non-TPU platform runs the Pallas
    interpreter instead of raising (slow; for tests of the masks and the sharding)."""
    _INTERPRET.append(True)
    try:
        yield
    finally:
        _INTERPRET.pop()


def _platform(rules: Rules | None) -> str:
    if rules is not None:
        return next(iter(rules.mesh.devices.flat)).platform
    return jax.default_backend()


def _block(seq: int, block: int) -> int:
    """Kernel block size: ``block`` rounded to the 128-lane tile, capped at the padded length."""
    block = max(128, block - block % 128)
    return min(block, -(-seq // 128) * 128)


def _kernel(heads: int, seq: int, window: int, block: int, interpret: bool):
    """A splash MHA kernel for ``heads`` local heads (built per trace: it holds jnp arrays)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa  # TPU kernel: only when splash runs

    if window > 0:
        mask = sa.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
    else:
        mask = sa.CausalMask((seq, seq))
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                              q_seq_shards=1, interpret=interpret)


def segment_block_keep(seg, block: int, xp=jnp):
    """Which (query block, key block) pairs of a row a segment-masked kernel must compute:
    bool ``[S // block, S // block]`` for segment ids ``seg`` ``[S]`` (``S`` a multiple of
    ``block``; real segments >= 1, 0 = padding).

    A pair is kept when the blocks' ranges of real segment ids overlap (a superset of the
    pairs holding an equal-segment query and key, exact when segments are contiguous, as
    in packed rows), and on the diagonal. Causality and windows are the static mask's.
    ``xp``: ``jax.numpy`` in the kernel, ``numpy`` in cost estimates."""
    ids = seg.reshape(-1, block)
    real = ids > 0
    lo = xp.where(real, ids, 2 ** 30).min(-1)
    hi = xp.where(real, ids, 0).max(-1)
    overlap = (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None])
    return overlap | xp.eye(ids.shape[0], dtype=bool)


def restrict_mask_info(info, keep, *, dkv: bool = False):
    """A splash ``MaskInfo`` whose blocks outside ``keep`` [q blocks, kv blocks] are skipped.

    Entry ``[h, i, j]`` of the forward and dq infos is query block ``i`` and key block
    ``data_next[h, i, j]``; of the dkv info (``dkv=True``) query block ``data_next[h, i, j]``
    and key block ``j``, its grid running over ``i``. A skipped entry's ``block_mask`` is 0
    (no compute) and its ``data_next`` repeats the last kept entry's along the grid (the
    first's before any), so the pipeline fetches no block for it."""
    if info is None or info.block_mask is None:
        return info
    nxt = info.data_next.astype(jnp.int32)
    if dkv:
        run = keep[nxt, jnp.arange(nxt.shape[2])[None, None, :]]
        axis = 1
    else:
        run = keep[jnp.arange(nxt.shape[1])[None, :, None], nxt]
        axis = 2
    run &= info.block_mask > 0
    step = jax.lax.broadcasted_iota(jnp.int32, nxt.shape, axis)
    last = jax.lax.cummax(jnp.where(run, step, -1), axis=axis)
    first = jax.lax.cummin(jnp.where(run, step, nxt.shape[axis]), axis=axis, reverse=True)
    held = jnp.where(last >= 0, last, jnp.where(first < nxt.shape[axis], first, step))
    data_next = jnp.take_along_axis(nxt, held, axis=axis).astype(info.data_next.dtype)
    block_mask = jnp.where(run, info.block_mask, 0).astype(info.block_mask.dtype)
    return info._replace(data_next=data_next, block_mask=block_mask)


def _row_kernel(kernel, seg, block: int):
    """``kernel`` with its mask infos restricted to row ``seg``'s segment blocks."""
    keep = segment_block_keep(seg, block)
    return type(kernel)(restrict_mask_info(kernel.fwd_mask_info, keep),
                        restrict_mask_info(kernel.dq_mask_info, keep),
                        restrict_mask_info(kernel.dkv_mask_info, keep, dkv=True), **kernel.kwargs)


def _local(q, k, v, seg, window, *, windows, block, interpret):
    """Per-shard body: q [b, H, S, hd] (pre-scaled), k / v [b, KV, S, hd], seg [b, S]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds  # TPU kernel, as above

    heads, seq = q.shape[1], q.shape[2]

    def run(w):
        kernel = _kernel(heads, seq, int(w), block, interpret)

        def row(qi, ki, vi, si):
            return _row_kernel(kernel, si, block)(qi, ki, vi, SegmentIds(si, si))
        return jax.vmap(row)(q, k, v, seg)

    if len(windows) == 1:
        return run(windows[0])
    index = sum(jnp.where(window == w, i, 0) for i, w in enumerate(windows))
    return jax.lax.switch(index, [functools.partial(run, w) for w in windows])


def splash_attention(q, k, v, k_valid, window, scale, *, windows=(0,), rules: Rules | None = None,
                     block: int = 512, segment_ids=None):
    """Causal / sliding-window GQA attention with the splash kernel; returns [B, S, KV, G, hd].

    Args:
      q: [B, S, KV, G, hd]; k, v: [B, S, KV, hd]; positions are implicitly 0 .. S-1.
      k_valid: [B, S] bool, False on padding.
      window: traced or static int, 0 = full causal; must be one of ``windows``.
      windows: every window value the caller may pass (static; e.g. ``(0, 4096)``).
      rules: the mesh and logical-axis rules (shard_map over it); None = one device.
      block: kernel block size (q and kv, forward and backward).
      segment_ids: [B, S] int32 packed-row segments (>= 1; 0 = padding) or None (one segment
        per row); positions restart at 0 in each segment, so the index-based masks stay exact.
    """
    platform = _platform(rules)
    interpret = _INTERPRET[-1]
    if platform != "tpu" and not interpret:
        raise ValueError(f"attention_impl='splash' is a TPU (Mosaic) kernel and cannot run on {platform}; "
                         "use attention_impl='blockwise' there.")
    windows = tuple(sorted({int(w) for w in windows}))
    B, S, KV, G, hd = q.shape
    bs = _block(S, block)
    pad = (-S) % bs
    qh = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(B, S, KV * G, hd)
    qh, kh, vh = (jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (qh, k, v))
    seg = k_valid.astype(jnp.int32) if segment_ids is None else jnp.where(k_valid, segment_ids.astype(jnp.int32), 0)
    seg = jnp.pad(seg, ((0, 0), (0, pad)))
    window = jnp.asarray(window, jnp.int32)
    body = functools.partial(_local, windows=windows, block=bs, interpret=interpret)
    if rules is None:
        out = body(qh, kh, vh, seg, window)
    else:
        bspec = rules.spec(("act_batch",), (B,))[0]
        hspec = rules.spec(("act_kv_heads",), (KV,))[0]
        qkv = P(bspec, hspec, None, None)
        out = jax.shard_map(body, mesh=rules.mesh, in_specs=(qkv, qkv, qkv, P(bspec, None), P()),
                            out_specs=qkv, check_vma=False)(qh, kh, vh, seg, window)
    out = jnp.swapaxes(out[:, :, :S], 1, 2).reshape(B, S, KV, G, hd)
    return out.astype(q.dtype)
