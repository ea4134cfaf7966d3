"""Batched KV-cache sampler: warpers vs transformers, sampling frequencies, greedy parity with
``transformers.generate``, raw log-probs vs the training forward across reused-cache turns,
stop strings, and sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from lopd_jax.method.losses import chunked_token_logp
from models import from_pretrained
from lopd_jax.settings.sections import MeshConfig, SamplingParams
from models.partitioning import split_state, tree_shardings
from train.mesh import make_mesh, put, rules_for
from benchmarks.static_sampler import BucketConfig, Sampler, bucket, processed_logprobs, sample_logits

V_HF = 96
NEW = 40


def _full_processed(logits, temperature, top_p, top_k):
    lp, idx = processed_logprobs(jnp.asarray(logits), temperature, top_p, top_k)
    out = np.full(logits.shape, -np.inf, np.float32)
    np.put_along_axis(out, np.asarray(idx), np.asarray(lp), axis=-1)
    return out


def _hf_processed(logits, temperature, top_p, top_k):
    scores = torch.tensor(logits)
    for w in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        scores = w(None, scores)
    return torch.log_softmax(scores, dim=-1).numpy()


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.95, 20), (1.3, 0.5, 0), (0.5, 0.8, 5)])
def test_processed_distribution_matches_transformers_warpers(temperature, top_p, top_k):
    logits = np.random.RandomState(0).randn(6, 64).astype(np.float32) * 2.5
    ours = _full_processed(logits, temperature, top_p, top_k)
    ref = _hf_processed(logits, temperature, top_p, top_k if top_k else 64)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(ours[fin], ref[fin], atol=1e-5)
    assert (np.isfinite(ours).sum(-1) < 64).all()  # the filters really dropped something


def test_sampling_never_emits_excluded_tokens_and_matches_frequencies():
    base = np.log(np.array([0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.04, 0.02], np.float32))
    n = 40_000
    logits = jnp.asarray(np.tile(base, (n, 1)))
    temperature, top_p, top_k = 0.9, 0.8, 5
    expected = np.exp(_full_processed(np.asarray(logits[:1]), temperature, top_p, top_k)[0])
    assert expected[5:].sum() == 0 and (expected[:3] > 0).all()
    tok, lp, raw = jax.jit(sample_logits, static_argnums=4)(logits, jax.random.key(3), temperature, top_p, top_k)
    tok, lp, raw = map(np.asarray, (tok, lp, raw))
    counts = np.bincount(tok, minlength=8)
    assert counts[expected == 0].sum() == 0
    sigma = np.sqrt(n * expected * (1 - expected))
    assert (np.abs(counts - n * expected) <= 5 * sigma + 1).all(), (counts, n * expected)
    np.testing.assert_allclose(lp, np.log(expected[tok]), atol=1e-5)
    np.testing.assert_allclose(raw, base[tok] - np.log(np.exp(base).sum()), atol=1e-5)
    # greedy: the first maximal id, a point mass (log-prob 0); per-row temperatures mix modes
    tie = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [3.0, 0.0, 1.0, 0.5]])
    t, lp, _ = sample_logits(tie, jax.random.key(0), jnp.asarray([0.0, 0.0]), 0.9, 0)
    assert np.asarray(t).tolist() == [1, 0] and np.asarray(lp).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("spread", [0.3, 1.5])
def test_top_p_without_top_k_matches_full_sort(spread):
    """top_k = 0: the top-candidates shortcut (peaked logits, spread 1.5) and the full-sort
    fallback (flat logits: 64 candidates hold < top_p) both sample the full-sort
    distribution: only kept ids, with its log-probs, at its frequencies."""
    V, n = 200, 4000
    base = np.random.RandomState(1).randn(V).astype(np.float32) * spread
    temperature, top_p = 0.8, 0.7
    expected = np.exp(_full_processed(base[None], temperature, top_p, 0)[0])
    kept = expected > 0
    assert 1 < kept.sum() < V and (kept.sum() > 64) == (spread < 1)
    tok, lp, _ = jax.jit(sample_logits, static_argnums=4)(jnp.asarray(np.tile(base, (n, 1))), jax.random.key(2),
                                                          temperature, top_p, 0)
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert kept[tok].all()
    np.testing.assert_allclose(lp, np.log(expected[tok]), atol=1e-5)
    top = np.argsort(-expected)[:3]
    counts = np.bincount(tok, minlength=V)[top]
    sigma = np.sqrt(n * expected[top] * (1 - expected[top]))
    assert (np.abs(counts - n * expected[top]) <= 5 * sigma + 1).all()


def test_buckets_and_validation():
    assert bucket(5) == 8 and bucket(5, minimum=16) == 16 and bucket(17, (12, 24, 48)) == 24
    assert bucket(100, (12, 24, 48)) == 128 and bucket(3, multiple_of=4) == 4 and bucket(5, multiple_of=6) == 12
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="ascending"):
        BucketConfig(chunk=(32, 16))


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny random transformers Qwen3 model and the same weights loaded by from_pretrained."""
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=V_HF, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=1e6,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    hm = transformers.Qwen3ForCausalLM(hc).eval()
    with torch.no_grad():
        for p in hm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    path = str(tmp_path_factory.mktemp("sampler_hf") / "qwen3")
    hm.save_pretrained(path)
    return hm, from_pretrained(path)


PROMPTS = [[3, 17, 42, 8, 91], [5, 6, 7, 60, 61, 2, 9, 33, 70, 12, 44]]


def _decode(ids):
    """An id -> text map for stop-string tests."""
    return " ".join(f"t{i}" for i in ids) + " "


@pytest.fixture(scope="module")
def greedy_run(hf_pair):
    _, model = hf_pair
    sampler = Sampler(model, stop_ids=(), sampling=SamplingParams(temperature=0.0), decode=_decode)
    gen = sampler.generate(Sampler.params_of(model), PROMPTS, NEW, jax.random.key(0))
    return sampler, gen


def test_greedy_matches_transformers_generate(hf_pair, greedy_run):
    hm, _ = hf_pair
    _, gen = greedy_run
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = hm.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(prompt):].numpy()
        assert gen.tokens[i].tolist() == ref.tolist()
        assert gen.finish_reasons[i] == "length" and (gen.logprobs[i] == 0).all()
        ref_lp = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1).numpy()[np.arange(NEW), ref]
        np.testing.assert_allclose(gen.raw_logprobs[i], ref_lp, atol=1e-4)


def test_stop_string_truncates_and_rewinds_cache(hf_pair, greedy_run):
    _, model = hf_pair
    sampler, gen = greedy_run
    toks = gen.tokens[1]
    stop = f"t{toks[6]} t{toks[7]} "
    first = next(j for j in range(1, NEW + 1) if stop in _decode(toks[:j]))
    params = Sampler.params_of(model)
    cache = sampler.new_cache(2)
    g, cache = sampler.extend(params, cache, PROMPTS, NEW, jax.random.key(0), stop_strings=(stop,))
    assert g.tokens[1].tolist() == toks[:first].tolist() and g.finish_reasons[1] == "stop_string"
    assert g.tokens[0].tolist() == gen.tokens[0].tolist() and g.finish_reasons[0] == "length"
    assert cache.lengths[1] == len(PROMPTS[1]) + first - 1
    # the rewound cache continues exactly like a fresh prefill of the truncated sequence;
    # the same length buckets (cap 33 -> 64 new, capacity 64) reuse the compiled turn
    g2, _ = sampler.extend(params, cache, [None, [int(toks[first - 1]), 4, 5]], 33, jax.random.key(1))
    assert sampler.num_compiled == 1
    seq = PROMPTS[1] + toks[:first].tolist() + [4, 5] + g2.tokens[1][:1].tolist()
    ref = _training_logp(model, [seq])[0]
    np.testing.assert_allclose(g2.raw_logprobs[1][0], ref[-1], atol=1e-4)
    assert g2.tokens[0] is None


def _training_logp(model, seqs, width=48):
    """log pi(seq[j] | seq[:j]) at index j - 1 (j >= 1) for each of ``seqs``, from one jitted
    plain (training-style) forward over the right-padded batch."""
    ids = np.zeros((len(seqs), width), np.int32)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = seq
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids):
        m = nnx.merge(graphdef, state)
        h = m(ids, return_hidden=True)
        return chunked_token_logp(h[:, :-1], m.lm_head_kernel(), ids[:, 1:], chunk_size=16)

    out = np.asarray(fwd(state, jnp.asarray(ids)))
    return [out[b, : len(seq) - 1] for b, seq in enumerate(seqs)]


def test_raw_logprobs_equal_training_forward_across_reused_cache_turns(hf_pair):
    _, model = hf_pair
    stop = 7
    sampler = Sampler(model, stop_ids=(stop,), sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=20),
                      buckets=BucketConfig(minimum=8, batch=(4,)), prefill_block=4)  # 2 prefill blocks
    params = Sampler.params_of(model)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8], [20, 21, 22, 23]]
    caps = [12, 6, 12]
    cache = sampler.new_cache(3)
    g1, cache = sampler.extend(params, cache, prompts, caps, jax.random.key(0))
    for i in range(3):
        n = len(g1.tokens[i])
        assert 1 <= n <= caps[i] and (stop not in g1.tokens[i][:-1].tolist())
        assert g1.finish_reasons[i] == ("stop" if g1.tokens[i][-1] == stop else "length")
        assert n == caps[i] or g1.tokens[i][-1] == stop
    # drop row 1, reorder, then a second turn on the compacted, reused cache
    cache = sampler.compact(cache, [2, 0])
    assert cache.batch == 4 and cache.lengths[2:].tolist() == [0, 0]
    obs = {2: [30, 31, 32], 0: [40]}
    chunks = [[int(g1.tokens[i][-1])] + obs[i] for i in (2, 0)]
    g2, cache = sampler.extend(params, cache, chunks, 10, jax.random.key(1))
    seqs = [prompts[i] + g1.tokens[i].tolist() + obs[i] + g2.tokens[r].tolist() for r, i in enumerate((2, 0))]
    refs = _training_logp(model, seqs)
    for r, i in enumerate((2, 0)):
        seq, ref = seqs[r], refs[r]
        a, n1 = len(prompts[i]), len(g1.tokens[i])
        b = a + n1 + len(obs[i])
        np.testing.assert_allclose(g1.raw_logprobs[i], ref[a - 1:a - 1 + n1], atol=1e-4)
        np.testing.assert_allclose(g2.raw_logprobs[r], ref[b - 1:b - 1 + len(g2.tokens[r])], atol=1e-4)
        assert cache.lengths[r] == len(seq) - 1
        assert (g2.logprobs[r] <= 0).all() and (g2.logprobs[r] >= g2.raw_logprobs[r] - 5).all()
    assert len(g2.tokens) == 2
    assert sampler.num_compiled == 1  # same buckets on turn 2: no recompilation


def test_sharded_sampling_equals_unsharded(hf_pair, greedy_run):
    _, model = hf_pair
    _, gen = greedy_run
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), devices=jax.devices()[:2])
    rules = rules_for(mesh)
    sampler = Sampler(model, stop_ids=(), sampling=SamplingParams(temperature=0.0), rules=rules)
    assert sampler.batch_shards == 2
    _, (params,), (axes,) = split_state(model, nnx.Param)
    params = put(params, tree_shardings(params, axes, rules))  # parameters fsdp-sharded too
    assert not params["embed"].sharding.is_fully_replicated
    g = sampler.generate(params, PROMPTS, NEW, jax.random.key(0))
    for i in range(2):
        assert g.tokens[i].tolist() == gen.tokens[i].tolist()
        np.testing.assert_allclose(g.raw_logprobs[i], gen.raw_logprobs[i], atol=1e-5)
