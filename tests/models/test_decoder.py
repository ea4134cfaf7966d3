"""Decoder internals: blockwise vs plain attention, KV-cache decoding, LoRA, remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention as A
from models.config import LoraConfig, named_config
from models.decoder import Decoder
from models.lora import LoRAParam


def _randomize(model, seed=0, scale=0.05):
    """Perturb every parameter (norm weights included) so no test passes by symmetry."""
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    return model


@pytest.fixture(scope="module")
def models():
    out = {}
    for name in ("tiny_qwen3", "tiny_olmo3"):
        cfg = named_config(name, lora=LoraConfig(rank=4, alpha=8.0))
        out[name] = _randomize(Decoder(cfg, rngs=nnx.Rngs(1)))
    return out


@pytest.mark.parametrize("impl", ["blockwise", "causal_plain"])
@pytest.mark.parametrize("window", [0, 5])
def test_blockwise_attention_matches_plain_values_and_grads(window, impl):
    rng = np.random.RandomState(0)
    B, S, KV, G, hd = 2, 19, 2, 2, 8
    q = jnp.asarray(rng.randn(B, S, KV, G, hd), jnp.float32)
    k = jnp.asarray(rng.randn(B, S, KV, hd), jnp.float32)
    v = jnp.asarray(rng.randn(B, S, KV, hd), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    valid = jnp.asarray(np.arange(S)[None] < np.array([[S], [11]]))
    w = jnp.asarray(rng.randn(B, S, KV, G, hd), jnp.float32) * valid[:, :, None, None, None]

    def loss(impl, q, k, v):
        o = A.attention(q, k, v, pos, pos, valid, window, 0.3, impl=impl, block_q=4, block_kv=8)
        return jnp.sum(o * w)

    plain = jax.value_and_grad(lambda *a: loss("plain", *a), argnums=(0, 1, 2))(q, k, v)
    block = jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(block[0], plain[0], rtol=1e-5, atol=1e-5)
    for gb, gp in zip(block[1], plain[1]):
        np.testing.assert_allclose(gb, gp, rtol=1e-4, atol=1e-5)


def test_blockwise_skips_blocks_without_an_allowed_pair():
    """Segments aligned to 8-token blocks: NaN values in segment 1 reach segment 2 only
    through the blocks across the segments, which the kernel skips (forward and backward);
    every block of a computed pair would spread the NaN (0 * NaN). A row of padding only
    gets a zero output, finite gradients."""
    rng = np.random.RandomState(5)
    B, S, KV, G, hd = 2, 32, 1, 2, 8
    q = jnp.asarray(rng.randn(B, S, KV, G, hd), jnp.float32)
    k = jnp.asarray(rng.randn(B, S, KV, hd), jnp.float32)
    v = jnp.asarray(rng.randn(B, S, KV, hd), jnp.float32).at[0, :16].set(jnp.nan)
    seg = jnp.asarray(np.stack([np.repeat([1, 2], 16), np.zeros(S, int)]), jnp.int32)
    valid = seg > 0
    pos = jnp.asarray(np.stack([np.tile(np.arange(16), 2), np.arange(S)]))
    w = jnp.zeros((B, S, KV, G, hd), bool).at[0, 16:].set(True)

    def loss(q, k, v):
        o = A.blockwise_attention(q, k, v, pos, pos, valid, 0, 0.3, 8, 8, q_seg=seg, k_seg=seg)
        return jnp.sum(jnp.where(w, o, 0.0)), o

    (val, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert np.isfinite(float(val))
    assert np.isfinite(np.asarray(out[0, 16:])).all() and np.isnan(np.asarray(out[0, :16])).any()
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    for g in grads:
        assert np.isfinite(np.asarray(g[0, 16:])).all() and np.isfinite(np.asarray(g[1])).all()
    want = A.plain_attention(q[:1, 16:], k[:1, 16:], v[:1, 16:], pos[:1, 16:], pos[:1, 16:], valid[:1, 16:], 0, 0.3)
    np.testing.assert_allclose(np.asarray(out[:1, 16:]), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_causal_plain_decoder_matches_plain_and_falls_back_off_default_positions(models):
    """``causal_plain`` skips the key tiles after each query tile: exact for the default
    positions (values and gradients), and the decoder uses plain attention whenever positions
    are given (with other positions the skipped keys could be visible)."""
    base = models["tiny_qwen3"]
    graphdef, state = nnx.split(base)
    causal = nnx.merge(graphdef, state)
    causal.cfg = base.cfg.replace(attention_impl="causal_plain", attention_block_q=4)
    plain = nnx.merge(graphdef, state)
    ids = jnp.asarray(np.random.RandomState(3).randint(0, base.cfg.vocab_size, (2, 13)))
    mask = jnp.asarray(np.arange(13)[None] < np.array([[13], [9]]))

    def loss(m):
        return jnp.sum(jax.nn.log_softmax(m(ids, attention_mask=mask)) * mask[..., None])

    (lc, gc), (lp, gp) = nnx.value_and_grad(loss)(causal), nnx.value_and_grad(loss)(plain)
    np.testing.assert_allclose(lc, lp, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gp)):
        # the same sums in other matmul shapes: fp32 rounding, relative to the leaf's scale
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5 * max(1.0, float(jnp.abs(b).max())))
    # reversed positions: the tiles causal_plain would skip hold visible keys; the decoder
    # must see that and attend with plain attention
    rev = jnp.broadcast_to(jnp.arange(13)[::-1], (2, 13))
    np.testing.assert_allclose(causal(ids, positions=rev), plain(ids, positions=rev), rtol=1e-5, atol=1e-5)
    q = jnp.asarray(np.random.RandomState(4).randn(1, 8, 1, 1, 4), jnp.float32)
    kv = jnp.asarray(np.random.RandomState(5).randn(1, 8, 1, 4), jnp.float32)
    pos, ok = jnp.arange(8)[None, ::-1], jnp.ones((1, 8), bool)
    skipped = A.attention(q, kv, kv, pos, pos, ok, 0, 0.5, impl="causal_plain", block_q=4)
    assert not np.allclose(skipped, A.attention(q, kv, kv, pos, pos, ok, 0, 0.5, impl="plain"), atol=1e-3)


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_olmo3"])
def test_kv_cache_incremental_equals_full_forward(models, name):
    model = models[name]
    rng = np.random.RandomState(1)
    B, S, prompt = 2, 20, np.array([7, 4])
    ids = jnp.asarray(rng.randint(0, model.cfg.vocab_size, (B, S)))
    full = model(ids)
    cache = model.init_cache(B, 32)
    pmask = jnp.asarray(np.arange(8)[None] < prompt[:, None])
    logits, cache = model(ids[:, :8], attention_mask=pmask, cache=cache)
    np.testing.assert_array_equal(cache.lengths, prompt)
    for b in range(B):
        np.testing.assert_allclose(logits[b, : prompt[b]], full[b, : prompt[b]], atol=2e-5)
    # decode one token per sequence: each sequence continues from its own length
    step = jax.jit(lambda m, tok, c: m(tok, cache=c))
    for t in range(S - prompt.max()):
        pos = np.asarray(cache.lengths)
        tok = ids[jnp.arange(B), jnp.asarray(pos)][:, None]
        logits, cache = step(model, tok, cache)
        for b in range(B):
            np.testing.assert_allclose(logits[b, 0], full[b, pos[b]], atol=2e-5)
    np.testing.assert_array_equal(cache.lengths, prompt + S - prompt.max())


def test_kv_cache_masked_decode_token_does_not_advance(models):
    model = models["tiny_qwen3"]
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 512, (2, 6)))
    cache = model.init_cache(2, 16)
    _, cache = model(ids, cache=cache)
    tok = jnp.asarray([[3], [5]])
    _, cache2 = model(tok, cache=cache, attention_mask=jnp.asarray([[True], [False]]))
    np.testing.assert_array_equal(cache2.lengths, [7, 6])


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_olmo3"])
def test_lora_zero_b_merge_and_disable(models, name):
    cfg = models[name].cfg
    model = _randomize(Decoder(cfg, rngs=nnx.Rngs(3)))
    ids = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 12)))
    base = model(ids)
    np.testing.assert_allclose(model(ids, lora=True), base, atol=1e-6)  # B = 0
    # give every B factor random values: LoRA now changes the output ...
    lora_state = nnx.state(model, LoRAParam)
    leaves, tree = jax.tree.flatten(lora_state)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    with_lora = model(ids, lora=True)
    assert np.abs(np.asarray(with_lora - base)).max() > 1e-3
    np.testing.assert_allclose(model(ids, lora=False), base, atol=1e-6)  # disabled = base
    model.merge_lora()
    np.testing.assert_allclose(model(ids), with_lora, atol=2e-5)  # merged = unmerged


def test_lora_dropout_changes_only_with_rng(models):
    cfg = models["tiny_qwen3"].cfg.replace(lora=LoraConfig(rank=4, alpha=8.0, dropout=0.5))
    model = _randomize(Decoder(cfg, rngs=nnx.Rngs(5)))
    b = model.lora_q_b
    b.set_value(b[...] + 0.1)
    ids = jnp.arange(10)[None]
    det = model(ids, lora=True)
    np.testing.assert_allclose(model(ids, lora=True), det)
    assert np.abs(np.asarray(model(ids, lora=True, dropout_rng=jax.random.key(0)) - det)).max() > 1e-4


def test_remat_and_unscanned_give_identical_gradients(models):
    base_cfg = models["tiny_olmo3"].cfg
    ids = jnp.asarray(np.random.RandomState(6).randint(0, 512, (2, 10)))
    grads = []
    for kw in [dict(), dict(remat_policy="full"), dict(remat_policy="dots"), dict(scan_layers=False)]:
        model = _randomize(Decoder(base_cfg.replace(**kw), rngs=nnx.Rngs(7)))

        def loss(m):
            return jnp.mean(jax.nn.log_softmax(m(ids))[..., 3])

        grads.append(jax.tree.leaves(nnx.grad(loss)(model)))
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_inputs_embeds_and_hidden_outputs(models):
    model = models["tiny_qwen3"]
    ids = jnp.asarray([[1, 2, 3, 4]])
    emb = model.embed_tokens(ids)
    np.testing.assert_allclose(model(inputs_embeds=emb), model(ids), atol=1e-6)
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (1, 4, model.cfg.hidden_size)
    np.testing.assert_allclose(model.logits(hidden), model(ids), atol=1e-5)
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=emb)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="layer_types"):
        named_config("tiny_qwen3", layer_types=("full_attention",))
    with pytest.raises(ValueError, match="remat_policy"):
        named_config("tiny_qwen3", remat_policy="sometimes")
    with pytest.raises(KeyError, match="known"):
        named_config("qwen3_9b")
    with pytest.raises(ValueError, match="LoRA targets"):
        LoraConfig(targets=("qkv",))
