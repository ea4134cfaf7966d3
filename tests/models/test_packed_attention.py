"""Packed rows (``segment_ids``): every segment of a packed row gives, on every attention
backend, the logits and parameter gradients it gives alone; perturbing one segment moves
only its own outputs; the segment mask and :func:`segment_positions` against hand-written
references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention as A, splash
from models.config import named_config
from models.decoder import Decoder
from models.layer import segment_positions

from tests.models.test_decoder import _randomize

LENS = (13, 21, 10)  # three trajectories; the middle one is the perturbed / differentiated one
ORDERS = ((0, 1, 2), (2, 0, 1))  # segments packed into rows 0 and 1
S = 48  # 44 tokens + 4 of tail padding per row
# blockwise: 8-query / 16-key blocks, so segment boundaries (13, 34, 44 / 10, 23, 44) fall
# inside blocks; causal_plain: 8-row tiles; splash: the kernel's 128 minimum
BLOCKS = {"plain": 8, "causal_plain": 8, "blockwise": 8, "splash": 128}


def test_segment_positions_restart_at_each_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 2, 2, 2, 2, 2, 2, 0], [4, 4, 4, 4, 4, 4, 4, 4]], jnp.int32)
    want = [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 4, 5, 6, 7]]
    np.testing.assert_array_equal(jax.jit(segment_positions)(seg), want)
    assert segment_positions(seg).dtype == jnp.int32


def _numpy_mask(q_pos, k_pos, k_valid, window, q_seg, k_seg):
    B, Sq, T = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    mask = np.zeros((B, Sq, T), bool)
    for b in range(B):
        for i in range(Sq):
            for j in range(T):
                d = q_pos[b, i] - k_pos[b, j]
                mask[b, i, j] = (k_valid[b, j] and d >= 0 and (window <= 0 or d < window)
                                 and q_seg[b, i] == k_seg[b, j])
    return mask


@pytest.mark.parametrize("window", [0, 3])
def test_segment_mask_and_kernels_match_numpy_reference(window):
    """``_allowed`` == a NumPy mask; plain attention == a NumPy softmax under it; blockwise
    (custom VJP) and causal tiles == plain in values and gradients, with boundaries inside
    blocks and queries attending to a different number of keys."""
    rng = np.random.RandomState(0)
    B, Sq, KV, G, hd = 2, 19, 2, 2, 8
    seg = np.asarray([[1] * 5 + [2] * 7 + [3] * 4 + [0] * 3, [1] * 11 + [2] * 8], np.int32)
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    valid = seg > 0
    valid[1, 4] = False  # a masked key inside a segment: attention_mask combines with segments
    want = _numpy_mask(pos, pos, valid, window, seg, seg)
    got = A._allowed(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(valid), window, jnp.asarray(seg),
                     jnp.asarray(seg))
    np.testing.assert_array_equal(got, want)

    q = rng.randn(B, Sq, KV, G, hd).astype(np.float32)
    k, v = rng.randn(2, B, Sq, KV, hd).astype(np.float32)
    s = np.einsum("bskgd,btkd->bkgst", q, k) * 0.3
    s = np.where(want[:, None, None], s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bkgst,btkd->bskgd", p / p.sum(-1, keepdims=True), v)
    rows = seg > 0  # every real token sees at least itself
    args = [jnp.asarray(x) for x in (pos, pos, valid)]
    segs = {"segment_ids": jnp.asarray(seg)}
    plain = A.attention(*map(jnp.asarray, (q, k, v)), *args, window, 0.3, impl="plain", **segs)
    np.testing.assert_allclose(np.asarray(plain)[rows], ref[rows], rtol=1e-5, atol=1e-5)

    w = jnp.asarray(rng.randn(B, Sq, KV, G, hd), jnp.float32) * rows[:, :, None, None, None]

    def loss(impl, q, k, v):
        return jnp.sum(A.attention(q, k, v, *args, window, 0.3, impl=impl, block_q=4, block_kv=8, **segs) * w)

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2))
    want_vg = grad(functools.partial(loss, "plain"))(*map(jnp.asarray, (q, k, v)))
    for impl in ("blockwise", "causal_plain"):
        got_vg = grad(functools.partial(loss, impl))(*map(jnp.asarray, (q, k, v)))
        np.testing.assert_allclose(got_vg[0], want_vg[0], rtol=1e-5, atol=1e-5)
        for g, r in zip(got_vg[1], want_vg[1]):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


# ----- the decoder on packed rows -----

@functools.lru_cache(maxsize=None)
def _base(name):
    """A tiny model with perturbed parameters: Qwen3, or Olmo-3 (sliding window 8 < every
    segment, YaRN on the full layers, post-norm)."""
    model = _randomize(Decoder(named_config(name), rngs=nnx.Rngs(1)))
    return nnx.split(model)


def _tokens(seed=0):
    """Per-segment token ids (one array per segment of LENS)."""
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 512, n).astype(np.int32) for n in LENS]


def _pack(segments):
    """(ids, segment_ids, middle-segment slices) for the rows of ORDERS."""
    ids, seg, spans = np.zeros((len(ORDERS), S), np.int32), np.zeros((len(ORDERS), S), np.int32), []
    for r, order in enumerate(ORDERS):
        at, row_spans = 0, {}
        for n, s in enumerate(order):
            ids[r, at:at + LENS[s]] = segments[s]
            seg[r, at:at + LENS[s]] = n + 1
            row_spans[s] = slice(at, at + LENS[s])
            at += LENS[s]
        spans.append(row_spans)
    return jnp.asarray(ids), jnp.asarray(seg), spans


@functools.lru_cache(maxsize=None)
def _packed_fn(name, impl):
    """jit: (params, ids, seg, w) -> (logits [2, S, V], d sum(middle segment logits * w) in both rows / d params)."""
    graphdef, params = _base(name)
    model = nnx.merge(graphdef, params)
    model.cfg = model.cfg.replace(attention_impl=impl, attention_block_q=BLOCKS[impl], attention_block_kv=16)
    graphdef, _ = nnx.split(model)
    mid = [spans[1] for spans in _pack(_tokens())[2]]

    def loss(params, ids, seg, w):
        logits = nnx.merge(graphdef, params)(ids, segment_ids=seg, attention_mask=seg > 0)
        return sum(jnp.sum(logits[r, m] * w) for r, m in enumerate(mid)), logits

    def run(params, ids, seg, w):
        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params, ids, seg, w)
        return logits, grads
    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _alone(name):
    """Each segment alone as its own unpadded row (plain attention, default positions):
    its logits, and the gradient of the middle segment's weighted logit sum."""
    graphdef, params = _base(name)
    segments, w = _tokens(), _weights()

    def loss(params):
        logits = [nnx.merge(graphdef, params)(jnp.asarray(t)[None])[0] for t in segments]
        return jnp.sum(logits[1] * w), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


def _weights():
    return jnp.asarray(np.random.RandomState(7).randn(LENS[1], 512), jnp.float32)


def _run(name, impl, segments):
    ids, seg, spans = _pack(segments)
    if impl != "splash":
        return _packed_fn(name, impl)(_base(name)[1], ids, seg, _weights()), spans
    with splash.interpret_on_cpu():
        return _packed_fn(name, impl)(_base(name)[1], ids, seg, _weights()), spans


@pytest.mark.parametrize("impl", ["plain", "causal_plain", "blockwise", "splash"])
@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_olmo3"])
def test_packed_row_equals_segments_alone(name, impl):
    (logits, grads), spans = _run(name, impl, _tokens())
    alone, alone_grads = _alone(name)
    for r, row_spans in enumerate(spans):
        for s, span in row_spans.items():
            np.testing.assert_allclose(logits[r, span], alone[s], rtol=1e-5, atol=1e-5,
                                       err_msg=f"row {r} segment {s}")
    if impl in ("plain", "blockwise"):  # the middle segment's loss in both rows = twice its loss alone
        for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(alone_grads)):
            np.testing.assert_allclose(g, 2 * want, rtol=1e-4, atol=2e-5 * max(1.0, float(jnp.abs(want).max())),
                                       err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_olmo3"])
def test_perturbing_one_segment_moves_only_its_outputs(name, impl):
    segments = _tokens()
    (before, _), spans = _run(name, impl, segments)
    segments[1] = _tokens(seed=1)[1]
    (after, _), _ = _run(name, impl, segments)
    for row_spans, b, a in zip(spans, before, after):
        for s, span in row_spans.items():
            if s == 1:
                assert np.abs(np.asarray(a[span] - b[span])).max() > 1e-2
            else:
                np.testing.assert_allclose(a[span], b[span], rtol=0, atol=1e-6)


def test_segment_ids_with_cache_or_explicit_positions():
    """A cache is refused; explicit positions (here the segments' own) run the non-index
    backend (causal_plain -> plain) with the segment mask and agree with the default."""
    graphdef, params = _base("tiny_qwen3")
    model = nnx.merge(graphdef, params)
    ids, seg, _ = _pack(_tokens())
    with pytest.raises(ValueError, match="segment_ids .*KV cache"):
        model(ids, segment_ids=seg, cache=model.init_cache(2, S))
    with pytest.raises(ValueError, match="segment_ids has shape"):
        model(ids, segment_ids=seg[:, :-1])
    (default, _), _ = _run("tiny_qwen3", "causal_plain", _tokens())
    model.cfg = model.cfg.replace(attention_impl="causal_plain", attention_block_q=8)
    explicit = jax.jit(lambda m, i, s: m(i, segment_ids=s, positions=segment_positions(s),
                                         attention_mask=s > 0))(model, ids, seg)
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(explicit)[real], np.asarray(default)[real], rtol=1e-5, atol=1e-5)
