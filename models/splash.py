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


def _local(q, k, v, seg, window, *, windows, block, interpret):
    """Per-shard body: q [b, H, S, hd] (pre-scaled), k / v [b, KV, S, hd], seg [b, S]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds  # TPU kernel, as above

    heads, seq = q.shape[1], q.shape[2]

    def run(w):
        kernel = _kernel(heads, seq, int(w), block, interpret)
        return jax.vmap(lambda qi, ki, vi, si: kernel(qi, ki, vi, SegmentIds(si, si)))(q, k, v, seg)

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
