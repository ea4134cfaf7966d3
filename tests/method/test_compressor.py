"""Tests for lopd_jax.method.compressor: NumPy parity, weight sharing, padding, gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lopd_jax.method.compressor import Compressor

D, HEADS, K, DEPTH = 16, 4, 5, 3


def _np(x):
    return np.asarray(x, dtype=np.float64)


def _erf(x):
    return np.vectorize(math.erf)(x)


def _ln(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * _np(p.scale[...]) + _np(p.bias[...])


def _lin(x, p):
    y = x @ _np(p.kernel[...])
    if p.bias is not None:
        y = y + _np(p.bias[...])
    return y


def numpy_reference(comp: Compressor, hidden, mask):
    """Straight float64 NumPy transcription of docs/method.md, "Compressor", one sequence at a time."""
    b = comp.block
    hd = D // HEADS
    outs = []
    for h_raw, m in zip(_np(hidden), np.asarray(mask)):
        media = _lin(h_raw[m], comp.proj_in)  # padding rows simply removed
        lat = _np(comp.queries[...])
        for _ in range(DEPTH):
            hn, ln_ = _ln(media, b.norm_media), _ln(lat, b.norm_latents)
            kv = np.concatenate([hn, ln_], 0)
            q = (ln_ @ _np(b.q_proj.kernel[...])).reshape(K, HEADS, hd) * hd ** -0.25
            k = (kv @ _np(b.k_proj.kernel[...])).reshape(-1, HEADS, hd) * hd ** -0.25
            v = (kv @ _np(b.v_proj.kernel[...])).reshape(-1, HEADS, hd)
            s = np.einsum("qhd,khd->hqk", q, k)
            s = np.exp(s - s.max(-1, keepdims=True))
            s = s / s.sum(-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", s, v).reshape(K, D)
            lat = lat + att @ _np(b.o_proj.kernel[...])
            f = _lin(_ln(lat, b.ff_norm), b.ff_in)
            f = 0.5 * f * (1.0 + _erf(f / np.sqrt(2.0)))
            lat = lat + _lin(f, b.ff_out)
        outs.append(_ln(_lin(lat, comp.proj_out), comp.norm_out))
    return np.stack(outs)


def _randomize(model, seed):
    """Replace every parameter (LayerNorm affine included) with random values."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [0.3 * jax.random.normal(k, x.shape, x.dtype) + (1.0 if x.ndim == 1 else 0.0)
              for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def setup():
    comp = _randomize(Compressor(D, HEADS, num_latents=K, depth=DEPTH, rngs=nnx.Rngs(0)), 1)
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 7, D)).astype(np.float32)
    mask = np.ones((3, 7), bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    return comp, hidden, mask


def test_numpy_parity(setup):
    comp, hidden, mask = setup
    out = jax.jit(lambda h, m: comp(h, m))(hidden, mask)
    assert out.shape == (3, K, D) and out.dtype == jnp.float32
    ref = numpy_reference(comp, hidden, mask)
    assert np.max(np.abs(np.asarray(out) - ref)) <= 1e-5


def test_padding_does_not_influence_output(setup):
    comp, hidden, mask = setup
    garbage = hidden.copy()
    garbage[~mask] = np.float32(1e4) * np.sign(garbage[~mask])
    garbage[1, 5] = np.inf
    a = np.asarray(comp(jnp.asarray(hidden), jnp.asarray(mask)))
    b = np.asarray(comp(jnp.asarray(garbage), jnp.asarray(mask)))
    assert np.all(np.isfinite(b))
    np.testing.assert_array_equal(a, b)
    # The mask really matters: unmasking the padding changes the affected rows.
    c = np.asarray(comp(jnp.asarray(hidden), jnp.ones_like(mask)))
    assert np.abs(c[1] - a[1]).max() > 1e-3 and np.abs(c[0] - a[0]).max() == 0.0


def test_weights_shared_across_iterations():
    def count(depth):
        m = Compressor(D, HEADS, num_latents=K, depth=depth, rngs=nnx.Rngs(0))
        return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))

    n1, n8 = count(1), count(8)
    assert n1 == n8
    expected = K * D + 2 * (D * D + D) + 4 * D * D + 2 * (4 * D * D) + 4 * 2 * D  # FF Linears without bias
    assert n1 == expected


def test_logical_axes_on_every_param():
    m = Compressor(D, HEADS, num_latents=K, depth=2, rngs=nnx.Rngs(0))
    allowed = {"embed", "mlp", "heads", "kv", "latents"}
    params = list(nnx.iter_graph(m))
    n = 0
    for _, node in params:
        if isinstance(node, nnx.Param):
            axes = node.get_metadata()["logical_axes"]
            assert len(axes) == node[...].ndim and set(axes) <= allowed
            n += 1
    assert n == 19  # queries + proj_in, proj_out x2 + ff_in, ff_out (no bias) + 4 attention projections + 4 LayerNorms x2
    assert m.queries.get_metadata()["logical_axes"] == ("latents", "embed")
    assert m.block.ff_in.kernel.get_metadata()["logical_axes"] == ("embed", "mlp")
    for _, node in params:
        if isinstance(node, nnx.Param):
            axes = node.get_metadata()["logical_axes"]
            assert len(set(axes)) == len(axes), axes  # no mesh axis used twice
    assert float(jnp.std(m.queries[...])) == pytest.approx(D ** -0.5, rel=0.35)


def test_gradients_finite_and_nonzero(setup):
    comp, hidden, mask = setup

    def loss(model):
        return jnp.mean(model(jnp.asarray(hidden), jnp.asarray(mask)) ** 3)

    grads = nnx.grad(loss)(comp)
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert float(jnp.abs(grads.queries[...]).max()) > 0
    assert float(jnp.abs(grads.block.k_proj.kernel[...]).max()) > 0


def test_bad_shapes_raise():
    m = Compressor(D, HEADS, num_latents=K, depth=1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden states"):
        m(jnp.zeros((2, 3, D + 1)), jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="mask"):
        m(jnp.zeros((2, 3, D)), jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="multiple of"):
        Compressor(10, 3, rngs=nnx.Rngs(0))
