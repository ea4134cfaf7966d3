"""Grouped-query attention kernels: a plain reference, its causal-tile variant (skips the
tiles above the diagonal; the fastest on CPU) and a memory-efficient blockwise one (pure
JAX, any backend); :func:`attention` also dispatches to the Pallas splash kernel for TPU
(:mod:`models.splash`).

Masks are built from positions (and optional segment ids), so one code path serves causal
training, sliding windows, right-padded batches, packed rows, spliced sequences and KV-cache
decoding:

    allowed(q, k) = k_valid[k] and k_pos[k] <= q_pos[q] and (window <= 0 or q_pos - k_pos < window)
                    and (no segments or q_seg[q] == k_seg[k])

Shapes: q [B, S, KV, G, hd] (G = heads per kv head), k / v [B, T, KV, hd], q_pos [B, S],
k_pos [B, T], k_valid [B, T] bool, window a (possibly traced) int scalar, 0 = no window,
q_seg [B, S] / k_seg [B, T] int32 segment ids or both None.
Softmax statistics are kept in fp32. A query with no allowed key gets a finite, unused
output (never NaN), so padded rows are harmless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.splash import splash_attention

_MASK = -1e30


def _allowed(q_pos, k_pos, k_valid, window, q_seg=None, k_seg=None):
    """Boolean mask [B, S, T]; with segment ids a query sees only keys of its own segment."""
    if (q_seg is None) != (k_seg is None):
        raise ValueError("pass segment ids for queries and keys alike (q_seg and k_seg), or neither")
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    ok = (kp <= qp) & k_valid[:, None, :]
    if q_seg is not None:
        ok &= q_seg[:, :, None] == k_seg[:, None, :]
    return ok & ((window <= 0) | (qp - kp < window))


def plain_attention(q, k, v, q_pos, k_pos, k_valid, window, scale, *, q_seg=None, k_seg=None):
    """Reference attention materializing the [B, KV, G, S, T] scores. Returns [B, S, KV, G, hd]."""
    s = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * scale
    mask = _allowed(q_pos, k_pos, k_valid, window, q_seg, k_seg)[:, None, None]
    s = jnp.where(mask, s, _MASK)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bkgst,btkd->bskgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def causal_block_attention(q, k, v, q_pos, k_pos, k_valid, window, scale, block, *, q_seg=None, k_seg=None):
    """:func:`plain_attention` over the causal lower triangle of ``block`` x ``block`` tiles:
    query rows ``[i*block, (i+1)*block)`` see only keys ``[0, (i+1)*block)``, so the scores
    above the diagonal blocks are never computed (about half of them for long sequences).

    Exact only when every key after a query is masked for it -- self-attention with
    ``q_pos == k_pos`` strictly increasing along the sequence (the decoder's default
    positions, no cache), or increasing within each segment of ``q_seg == k_seg`` (packed
    rows); the full mask is still applied inside each tile.
    Returns [B, S, KV, G, hd]."""
    S = q.shape[1]
    if k.shape[1] != S:
        raise ValueError(f"causal block attention needs self-attention (queries {S}, keys {k.shape[1]})")
    outs = []
    for lo in range(0, S, block):
        hi = min(lo + block, S)
        segs = {} if q_seg is None else {"q_seg": q_seg[:, lo:hi], "k_seg": k_seg[:, :hi]}
        outs.append(plain_attention(q[:, lo:hi], k[:, :hi], v[:, :hi], q_pos[:, lo:hi], k_pos[:, :hi],
                                    k_valid[:, :hi], window, scale, **segs))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _blocks(x, size, axis=1):
    """[B, N*size, ...] -> [N, B, size, ...]; None stays None (absent segment ids)."""
    if x is None:
        return None
    n = x.shape[axis] // size
    x = x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x, axis=1):
    """Inverse of ``_blocks``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _pad_to(x, mult, axis, value=0):
    if x is None:
        return None
    n = x.shape[axis]
    pad = (-n) % mult
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def blockwise_attention(q, k, v, q_pos, k_pos, k_valid, window, scale, block_q=512, block_kv=512, *,
                        q_seg=None, k_seg=None):
    """Flash-style attention in pure JAX: O(S * block) memory forward and backward.

    Sequences are padded to block multiples internally. The backward pass is a custom VJP
    that recomputes scores block by block from the saved log-sum-exp. Segment ids (both or
    neither) are blocked like the positions; without them no segment test is traced.
    A (query block, key block) pair in which no query of any row may see any key -- above
    the causal diagonal, across segments, past a window, all padding -- is skipped
    (``lax.cond`` on its mask, forward and backward), so causal and packed rows cost about
    their allowed blocks.
    """
    S, T = q.shape[1], k.shape[1]
    bq, bk = min(block_q, S), min(block_kv, T)
    qp = _pad_to(q, bq, 1)
    qpos = _pad_to(q_pos, bq, 1)
    kp, vp = _pad_to(k, bk, 1), _pad_to(v, bk, 1)
    kpos = _pad_to(k_pos, bk, 1)
    kval = _pad_to(k_valid, bk, 1, value=False)
    qseg, kseg = _pad_to(q_seg, bq, 1), _pad_to(k_seg, bk, 1)
    window = jnp.asarray(window, jnp.int32)
    out = _flash(qp, kp, vp, qpos, kpos, kval, window, qseg, kseg, scale, bq, bk)
    return out[:, :S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _flash(q, k, v, q_pos, k_pos, k_valid, window, q_seg, k_seg, scale, bq, bk):
    return _flash_fwd(q, k, v, q_pos, k_pos, k_valid, window, q_seg, k_seg, scale, bq, bk)[0]


def _flash_fwd(q, k, v, q_pos, k_pos, k_valid, window, q_seg, k_seg, scale, bq, bk):
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    kposb, kvalb, ksegb = _blocks(k_pos, bk), _blocks(k_valid, bk), _blocks(k_seg, bk)

    def q_block(args):
        qi, qposi, qsegi = args  # [B, bq, KV, G, hd], [B, bq], [B, bq] or None
        B, _, KV, G, hd = qi.shape
        m0 = jnp.full((B, KV, G, bq), _MASK, jnp.float32)
        l0 = jnp.zeros((B, KV, G, bq), jnp.float32)
        a0 = jnp.zeros((B, KV, G, bq, hd), jnp.float32)

        def kv_step(carry, xs):
            kj, vj, kposj, kvalj, ksegj = xs
            mask = _allowed(qposi, kposj, kvalj, window, qsegi, ksegj)[:, None, None]

            def run(carry):
                m, l, acc = carry
                s = jnp.einsum("bskgd,btkd->bkgst", qi, kj, preferred_element_type=jnp.float32) * scale
                s = jnp.where(mask, s, _MASK)
                m_new = jnp.maximum(m, s.max(-1))
                corr = jnp.exp(m - m_new)
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                l = l * corr + p.sum(-1)
                acc = acc * corr[..., None] + jnp.einsum(
                    "bkgst,btkd->bkgsd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, l, acc

            return jax.lax.cond(jnp.any(mask), run, lambda c: c, carry), None

        (m, l, acc), _ = jax.lax.scan(kv_step, (m0, l0, a0), (kb, vb, kposb, kvalb, ksegb))
        seen = l > 0  # a query with no allowed key: output 0, log-sum-exp 0 (both unused)
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return jnp.moveaxis(out, 3, 1).astype(qi.dtype), lse  # [B, bq, KV, G, hd], [B, KV, G, bq]

    outs, lses = jax.lax.map(q_block, (_blocks(q, bq), _blocks(q_pos, bq), _blocks(q_seg, bq)))
    out = _unblocks(outs)
    return out, (q, k, v, q_pos, k_pos, k_valid, window, q_seg, k_seg, out, lses)


def _flash_bwd(scale, bq, bk, res, d_out):
    q, k, v, q_pos, k_pos, k_valid, window, q_seg, k_seg, out, lses = res
    qb, dob = _blocks(q, bq), _blocks(d_out, bq)
    qposb, qsegb = _blocks(q_pos, bq), _blocks(q_seg, bq)
    # D_i = rowsum(dO * O) per query, laid out like lse: [N, B, KV, G, bq]
    dsum = jnp.moveaxis(_blocks(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), bq), 2, -1)
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    kposb, kvalb, ksegb = _blocks(k_pos, bk), _blocks(k_valid, bk), _blocks(k_seg, bk)

    def kv_block(dq_acc, xs):
        kj, vj, kposj, kvalj, ksegj = xs

        def q_step(carry, ys):
            qi, doi, qposi, qsegi, lsei, di = ys
            mask = _allowed(qposi, kposj, kvalj, window, qsegi, ksegj)[:, None, None]

            def run(carry):
                dk, dv = carry
                s = jnp.einsum("bskgd,btkd->bkgst", qi, kj, preferred_element_type=jnp.float32) * scale
                p = jnp.where(mask, jnp.exp(s - lsei[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgst,bskgd->btkd", p, doi.astype(jnp.float32))
                dp = jnp.einsum("bskgd,btkd->bkgst", doi.astype(jnp.float32), vj.astype(jnp.float32))
                ds = p * (dp - di[..., None]) * scale
                dk = dk + jnp.einsum("bkgst,bskgd->btkd", ds, qi.astype(jnp.float32))
                return (dk, dv), jnp.einsum("bkgst,btkd->bskgd", ds, kj.astype(jnp.float32))

            def skip(carry):
                return carry, jnp.zeros(qi.shape, jnp.float32)

            return jax.lax.cond(jnp.any(mask), run, skip, carry)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        (dk, dv), dq_blocks = jax.lax.scan(q_step, (zeros, zeros), (qb, dob, qposb, qsegb, lses, dsum))
        return dq_acc + dq_blocks, (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq_blocks, (dkb, dvb) = jax.lax.scan(kv_block, dq0, (kb, vb, kposb, kvalb, ksegb))
    dq = _unblocks(dq_blocks).astype(q.dtype)
    dk, dv = _unblocks(dkb).astype(k.dtype), _unblocks(dvb).astype(v.dtype)
    return dq, dk, dv, None, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention(q, k, v, q_pos, k_pos, k_valid, window, scale, impl="plain", block_q=512, block_kv=512,
              windows=(0,), rules=None, segment_ids=None):
    """Dispatch to the configured attention implementation.

    ``splash`` (the Pallas TPU kernel, :mod:`models.splash`) takes positions to be
    ``0 .. S-1`` for queries and keys alike (ignoring ``q_pos`` / ``k_pos``; with segments,
    ``0 ..`` within each segment), needs every value ``window`` may take in the static
    ``windows``, and shard-maps over ``rules``' mesh. ``segment_ids`` [B, S] int32 (self-attention
    only; real segments >= 1, 0 = padding) restrict every query to the keys of its own segment.
    """
    segs = {}
    if segment_ids is not None:
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"segment_ids need self-attention (queries {q.shape[1]}, keys {k.shape[1]}); "
                             "pass q_seg / k_seg to the kernels for other layouts")
        segs = {"q_seg": segment_ids, "k_seg": segment_ids}
    if impl == "splash":
        return splash_attention(q, k, v, k_valid, window, scale, windows=windows, rules=rules, block=block_q,
                                segment_ids=segment_ids)
    if impl == "plain":
        return plain_attention(q, k, v, q_pos, k_pos, k_valid, window, scale, **segs)
    if impl == "causal_plain":
        return causal_block_attention(q, k, v, q_pos, k_pos, k_valid, window, scale, block_q, **segs)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, q_pos, k_pos, k_valid, window, scale, block_q, block_kv, **segs)
    raise ValueError(f"attention impl {impl!r} is unknown; use plain, causal_plain, blockwise or splash.")
