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

    with splash.interpret_on_cpu():
        got = jax.jit(jax.value_and_grad(lambda *a: loss("splash", *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss("plain", *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)
    for g, r in zip(got[1], want[1]):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


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
