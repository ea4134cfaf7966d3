"""Splash attention (Pallas TPU kernel) against the reference attention, via the Pallas
interpreter on CPU: masks (causal, sliding window, padding), GQA, the shard_map over a
mesh and the decoder dispatch. The TPU lowering itself is checked in test_compile_check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention as A, splash
from models.config import named_config
from models.decoder import Decoder
from lopd_jax.settings.sections import MeshConfig
from train import mesh as mesh_lib


def _qkv(B, S, KV, G, hd, seed=0):
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(B, S, KV, G, hd), jnp.float32)
    k = jnp.asarray(rng.randn(B, S, KV, hd), jnp.float32)
    v = jnp.asarray(rng.randn(B, S, KV, hd), jnp.float32)
    return q, k, v


@pytest.mark.parametrize("window", [0, 37])
def test_splash_matches_plain_values_and_grads(window):
    B, S, KV, G, hd = 2, 150, 2, 2, 16  # S not a block multiple: padded internally
    q, k, v = _qkv(B, S, KV, G, hd)
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    valid = jnp.asarray(np.arange(S)[None] < np.array([[S], [101]]))
    w = jnp.asarray(np.random.RandomState(1).randn(B, S, KV, G, hd), jnp.float32) * valid[:, :, None, None, None]

    def loss(impl, q, k, v):
        if impl == "plain":
            o = A.plain_attention(q, k, v, pos, pos, valid, window, 0.3)
        else:  # a traced window chosen among two static kernels
            o = A.attention(q, k, v, pos, pos, valid, jnp.int32(window), 0.3, impl="splash", block_q=128,
                            windows=(0, 37))
        return jnp.sum(o * w)

    _assert_splash_matches_plain(loss, q, k, v)


def _assert_splash_matches_plain(loss, q, k, v):
    """``loss(impl, q, k, v)``: splash (Pallas interpreter, jitted) == plain, in value and in
    the q, k, v gradients; returns the plain value."""
    with splash.interpret_on_cpu():
        got = jax.jit(jax.value_and_grad(lambda *a: loss("splash", *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss("plain", *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)
    for g, r in zip(got[1], want[1]):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    return want[0]


def test_splash_refuses_cpu_without_interpreter():
    q, k, v = _qkv(1, 128, 1, 1, 16)
    with pytest.raises(ValueError, match="TPU .*blockwise"):
        splash.splash_attention(q, k, v, jnp.ones((1, 128), bool), 0, 1.0)


def test_decoder_splash_sharded_equals_plain():
    """tiny Olmo-3 (sliding + full layers, post-norm) on a 4x2 mesh: splash under shard_map
    == the plain reference at every valid position; explicit positions fall back."""
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    rules = mesh_lib.rules_for(mesh)
    cfg = named_config("tiny_olmo3")
    ref = Decoder(cfg, rngs=nnx.Rngs(0))
    fast = Decoder(cfg.replace(attention_impl="splash", attention_block_q=128), rngs=nnx.Rngs(0), rules=rules)
    B, S = 4, 40
    ids = jnp.asarray(np.random.RandomState(2).randint(0, cfg.vocab_size, (B, S)))
    amask = jnp.asarray(np.arange(S)[None] < np.array([[S], [31], [7], [S - 1]]))
    want = ref(ids, attention_mask=amask, return_hidden=True)
    with splash.interpret_on_cpu():
        got = jax.jit(lambda m, x, a: m(x, attention_mask=a, return_hidden=True))(fast, ids, amask)
    valid = np.asarray(amask)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=1e-4, atol=1e-4)
    # explicit positions: index-based masks would be wrong in general -> blockwise, on CPU too
    pos = jnp.broadcast_to(jnp.arange(S), (B, S)) + 3
    np.testing.assert_allclose(np.asarray(fast(ids, attention_mask=amask, positions=pos, return_hidden=True))[valid],
                               np.asarray(ref(ids, attention_mask=amask, positions=pos, return_hidden=True))[valid],
                               rtol=1e-4, atol=1e-4)


def _packed_row_segments(S, lengths):
    seg = np.zeros(S, np.int32)
    start = 0
    for i, n in enumerate(lengths):
        seg[start:start + n] = i + 1
        start += n
    return seg


def test_segment_block_keep_pairs():
    """blocks of 4 over segments 1 (6 tokens), 2 (3), 3 (5), padding (2): pairs whose
    segment ranges overlap, plus the diagonal (the padding-only block)."""
    seg = _packed_row_segments(16, [6, 3, 5])
    keep = splash.segment_block_keep(seg, 4, xp=np)
    # block ranges: [1,1], [1,2], [2,3], [3,3] + padding
    want = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(keep, want)
    pad = _packed_row_segments(16, [5])  # blocks 2 and 3 hold only padding
    np.testing.assert_array_equal(splash.segment_block_keep(pad, 4, xp=np),
                                  np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], bool))


def test_restricted_mask_infos_skip_exactly_the_cross_segment_blocks():
    """The forward, dq and dkv infos of the causal kernel run exactly the causal pairs the
    segments keep, and a skipped grid step repeats the previous block index."""
    S, block = 1024, 128
    seg = jnp.asarray(_packed_row_segments(S, [300, 200, 260, 100]))
    keep = splash.segment_block_keep(seg, block)
    kernel = splash._kernel(2, S, 0, block, True)
    row = splash._row_kernel(kernel, seg, block)
    nb = S // block
    want = int(np.sum(np.tril(np.asarray(keep))))
    assert want < nb * (nb + 1) // 2
    for name, dkv in (("fwd_mask_info", False), ("dq_mask_info", False), ("dkv_mask_info", True)):
        info = getattr(row, name)
        if info is None:
            continue
        bm, nxt = np.asarray(info.block_mask)[0], np.asarray(info.data_next)[0]
        pairs = {(int(nxt[i, j]), j) if dkv else (i, int(nxt[i, j])) for i, j in zip(*np.nonzero(bm))}
        assert pairs == {(i, j) for i in range(nb) for j in range(i + 1) if keep[i, j]}, name
        lines = nxt.T if dkv else nxt  # one grid line per row: skipped steps hold a kept block
        for line, runs in zip(lines, (bm.T if dkv else bm) > 0):
            kept = [int(x) for x in line[runs]]
            held = []
            for x, r in zip(line, runs):
                held.append(int(x) if r else (held[-1] if held else kept[0]))
            assert [int(x) for x in line] == held, name


@pytest.mark.parametrize("window", [0, 96])
def test_splash_skipping_packed_row_equals_plain(window, monkeypatch):
    """A packed row of four segments over eight 128-blocks (and a second, unpacked row):
    splash with its cross-segment blocks skipped == the plain reference, values and grads;
    a restriction that drops a needed block changes the output (the interpreter honours it)."""
    B, S, KV, G, hd = 2, 1000, 1, 2, 16
    q, k, v = _qkv(B, S, KV, G, hd, seed=3)
    seg = np.stack([_packed_row_segments(S, [300, 200, 260, 170]), _packed_row_segments(S, [900])])
    valid = jnp.asarray(seg > 0)
    seg = jnp.asarray(seg)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in (300, 200, 260, 170, 70)])[None].repeat(2, 0))
    pos = pos.at[1].set(jnp.arange(S))
    w = jnp.asarray(np.random.RandomState(4).randn(B, S, KV, G, hd), jnp.float32) * valid[:, :, None, None, None]

    def loss(impl, q, k, v):
        if impl == "plain":
            o = A.plain_attention(q, k, v, pos, pos, valid, window, 0.3, q_seg=seg, k_seg=seg)
        else:
            o = A.attention(q, k, v, pos, pos, valid, window, 0.3, impl="splash", block_q=128, windows=(window,),
                            segment_ids=seg)
        return jnp.sum(o * w)

    want = _assert_splash_matches_plain(loss, q, k, v)

    real = splash.segment_block_keep  # drop the (2, 1) pair: block 2's queries of segment 2 need keys in block 1
    monkeypatch.setattr(splash, "segment_block_keep", lambda s, b, xp=jnp: real(s, b, xp).at[2, 1].set(False))
    with splash.interpret_on_cpu():
        broken = jax.jit(lambda *a: loss("splash", *a))(q, k, v)
    assert abs(float(broken) - float(want)) > 1e-3
