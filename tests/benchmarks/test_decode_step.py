"""The sampler's unrolled decode step equals the decoder's scanned cached call (Qwen3 and
Olmo-3 layouts: pre/post norm, per-head/full q-k norm, sliding windows, YaRN, LoRA), and
the two sampler loops give the same tokens and log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import LoraConfig, named_config
from models.decoder import Decoder
from benchmarks.decode_step import decode_step, from_layers, to_layers
from models.layer import layer_weights
from benchmarks.static_sampler import BucketConfig, Sampler
from lopd_jax.settings.sections import SamplingParams


def _model(name):
    cfg = named_config(name, lora=LoraConfig(rank=4, alpha=8.0))
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    state = nnx.state(model)  # every parameter perturbed, LoRA B included (non-zero update)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    return model


@pytest.mark.parametrize("name,lora", [("tiny_qwen3", False), ("tiny_olmo3", True)])
def test_decode_step_equals_decoder_cached_call(name, lora):
    model = _model(name)
    rng = np.random.RandomState(0)
    B, T, P = 3, 32, 14  # olmo: sliding window 8 < prompt, so windows matter
    prompt = jnp.asarray(rng.randint(0, 512, (B, P)), jnp.int32)
    plen = jnp.asarray([14, 9, 11], jnp.int32)
    cache = model.init_cache(B, T)
    _, cache = model(prompt, attention_mask=jnp.arange(P)[None] < plen[:, None], cache=cache, lora=lora,
                     return_hidden=True)
    assert cache.lengths.tolist() == [14, 9, 11]
    layers = layer_weights(model, lora)
    ks, vs = to_layers(cache)
    ref, lengths = cache, cache.lengths
    step = jax.jit(lambda ks, vs, tok, lengths, live: decode_step(model, layers, tok, lengths, live, ks, vs, lora))
    ref_step = jax.jit(lambda ref, tok, live: model(tok[:, None], positions=ref.lengths[:, None],
                                                    attention_mask=live[:, None], cache=ref, lora=lora,
                                                    return_hidden=True))
    for t in range(10):
        tok = jnp.asarray(rng.randint(0, 512, B), jnp.int32)
        live = jnp.asarray([True, t % 3 != 1, t < 6])  # rows pause and stop
        h_ref, ref = ref_step(ref, tok, live)
        h, lengths, ks, vs = step(ks, vs, tok, lengths, live)
        np.testing.assert_allclose(np.asarray(h)[np.asarray(live)], np.asarray(h_ref[:, 0])[np.asarray(live)],
                                   atol=2e-5, rtol=1e-5)
        assert lengths.tolist() == ref.lengths.tolist()
    back = from_layers(ks, vs, lengths)
    for b, n in enumerate(np.asarray(lengths)):  # filled slots equal (unfilled ones are never read)
        np.testing.assert_allclose(back.k[:, b, :n], ref.k[:, b, :n], atol=2e-5)
        np.testing.assert_allclose(back.v[:, b, :n], ref.v[:, b, :n], atol=2e-5)


def test_unrolled_and_scan_samplers_agree():
    model = _model("tiny_olmo3")
    params = Sampler.params_of(model)
    prompts = [[3, 17, 42, 8, 91, 5, 6, 7, 60, 61], [5, 6, 7], [9, 8, 7, 6, 5, 4]]
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=0)  # exercises the top-p-only path too
    out = {}
    for mode in ("unrolled", "scan"):
        s = Sampler(model, stop_ids=(11,), sampling=sp, buckets=BucketConfig(minimum=8), decode_layers=mode,
                    lora=True)
        cache = s.new_cache(3)
        g1, cache = s.extend(params, cache, prompts, [20, 12, 16], jax.random.key(4))
        g2, _ = s.extend(params, cache, [[int(t[-1]), 1, 2] for t in g1.tokens], 9, jax.random.key(5))
        out[mode] = (g1, g2)
    for ga, gb in zip(out["unrolled"], out["scan"]):
        for i in range(3):
            assert ga.tokens[i].tolist() == gb.tokens[i].tolist()
            np.testing.assert_allclose(ga.raw_logprobs[i], gb.raw_logprobs[i], atol=1e-5)
            np.testing.assert_allclose(ga.logprobs[i], gb.logprobs[i], atol=1e-5)
    assert sum(len(t) for t in out["scan"][0].tokens) > 12
    with pytest.raises(ValueError, match="decode_layers"):
        Sampler(model, stop_ids=(), decode_layers="fast")
