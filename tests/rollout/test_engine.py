"""The continuous-batching engine (lopd_jax/rollout/engine.py): greedy equality with
``transformers.generate`` over several turns with more episodes than slots (Qwen3 GQA and
Olmo-3 with a sliding window shorter than the sequence), sampled trajectories independent
of the slot count, a full page pool (waits and preemptions), failing / sleeping
environments, stop strings, input-embedding overrides, and :func:`lopd_jax.rollout.episodes.rollout` on
the engine independent of the batch split and the slots."""

import dataclasses
import threading

import jax
import numpy as np
import pytest
import torch
import transformers

from models import from_pretrained
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.episode_spec import EpisodeSpec
from lopd_jax.settings.sections import EngineConfig, SamplingParams
from tests.rollout.feeds import ScriptedFeed

V = 96


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, rope_theta=1e6, max_position_embeddings=256, tie_word_embeddings=False))


def _olmo3():
    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.2079441541679836}
    return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, rms_norm_eps=1e-6, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=1,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5}, "full_attention": yarn}))


def _pair(build, tmp_path_factory, name):
    torch.manual_seed(0)
    hm = build().eval()
    with torch.no_grad():
        for p in hm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    path = str(tmp_path_factory.mktemp("engine_hf") / name)
    hm.save_pretrained(path)
    return hm, from_pretrained(path)


@pytest.fixture(scope="module", params=["qwen3", "olmo3"])
def pair(request, tmp_path_factory):
    return _pair(_qwen3 if request.param == "qwen3" else _olmo3, tmp_path_factory, request.param)


def _hf_greedy(hm, context, n):
    with torch.no_grad():
        out = hm.generate(torch.tensor([context]), attention_mask=torch.ones(1, len(context), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(context):].numpy()
    lp = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1).numpy()[np.arange(n), ids]
    return ids, lp


def _scripted(n_turns, obs):
    """A step function: observation ``obs[t]`` after turn t, the episode over after ``n_turns``."""
    state = {"t": 0}

    def step(ids, lps, raws):
        state["t"] += 1
        return None if state["t"] >= n_turns else obs[state["t"] - 1]
    return step


# 5 episodes in 2 slots; prompts, per-turn caps (turns end mid-chunk at different steps)
PROMPTS = [[3, 17, 42, 8, 91], [5, 6, 7, 60, 61, 2, 9, 33, 70, 12, 44], [20, 21], [40, 41, 42, 43, 44, 45, 46], [9]]
TURNS = [3, 1, 2, 2, 3]
CAPS = [5, 9, 3, 7, 4]
OBS = [[50, 51], [52], [53, 54, 55]]


def test_greedy_equals_transformers_over_turns_with_more_episodes_than_slots(pair):
    hm, model = pair
    engine = Engine(model, stop_ids=(), config=EngineConfig(slots=2, page_size=8, decode_chunk=3, prefill_chunk=4),
                    sampling=SamplingParams(temperature=0.0))
    specs = [EpisodeSpec(p, 64, c, _scripted(t, OBS)) for p, t, c in zip(PROMPTS, TURNS, CAPS)]
    results = engine.run(_params(model), specs, jax.random.key(0))
    for p, t, c, res in zip(PROMPTS, TURNS, CAPS, results):
        assert len(res.turns) == t and res.error is None
        context = list(p)
        for j in range(t):
            ids, lp = _hf_greedy(hm, context, c)
            assert res.turns[j].tolist() == ids.tolist()
            np.testing.assert_allclose(res.raw_logprobs[j], lp, atol=1e-4)
            assert (res.logprobs[j] == 0).all()
            context += ids.tolist() + (OBS[j] if j < t - 1 else [])
        assert res.context == context
    m = engine.metrics
    assert m["decode_calls"] > 0 and 0 < m["utilisation"] <= 1 and m.get("preemptions", 0) == 0
    assert m["prefill_calls"] >= 3  # slots were refilled as episodes and turns ended


def _params(model):
    return Engine.params_of(model)


def _sampled_specs(n, stop_turns=3):
    rs = np.random.RandomState(1)
    prompts = [rs.randint(2, V, size=rs.randint(2, 14)).tolist() for _ in range(n)]
    return [EpisodeSpec(p, 48, 6 + i % 5, _scripted(1 + i % stop_turns, OBS)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _pair(_qwen3, tmp_path_factory, "qwen3_sampled")[1]


SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
STOPS = (0, 17)


@pytest.fixture(scope="module")
def pool_full_run(qwen):
    """2 slots and a pool too small for the work in flight: episodes of up to 48 tokens
    (3 pages of 16) and pages for 1.67 of them."""
    engine = Engine(qwen, stop_ids=STOPS, config=EngineConfig(slots=2, page_size=16, num_pages=5, decode_chunk=4,
                                                              prefill_chunk=8), sampling=SAMPLING)
    return engine.run(_params(qwen), _sampled_specs(7), jax.random.key(5)), engine.metrics


def _five_slots(qwen, env_workers=4):
    return Engine(qwen, stop_ids=STOPS, config=EngineConfig(slots=5, page_size=16, num_pages=64, decode_chunk=3,
                                                            prefill_chunk=8, env_workers=env_workers), sampling=SAMPLING)


def _same(a, b):
    for x, y in zip(a, b):
        assert [t.tolist() for t in x.turns] == [t.tolist() for t in y.turns]
        assert x.context == y.context
        for u, v in zip(x.raw_logprobs + x.logprobs, y.raw_logprobs + y.logprobs):
            np.testing.assert_allclose(u, v, atol=1e-5)


def test_sampled_trajectories_do_not_depend_on_slots_chunk_or_pool(qwen, pool_full_run):
    """5 slots, decode chunk 3, an ample pool == 2 slots, chunk 4, a pool that preempts."""
    engine = _five_slots(qwen)
    results = engine.run(_params(qwen), _sampled_specs(7), jax.random.key(5))
    assert engine.metrics.get("preemptions", 0) == 0
    _same(results, pool_full_run[0])
    ends = [t[-1] for r in results for t in r.turns]
    assert any(e in STOPS for e in ends) and not all(e in STOPS for e in ends)  # stop ids and caps both end turns
    assert any(len(r.turns) > 1 for r in results) and any(len(r.turns) == 1 for r in results)
    # a different seed gives different tokens (the check above can fail)
    other = engine.run(_params(qwen), _sampled_specs(7), jax.random.key(6))
    assert any(o.context != r.context for o, r in zip(other, results))


def test_full_page_pool_waits_and_preempts_and_every_episode_finishes(qwen, pool_full_run):
    results, m = pool_full_run  # equal to an ample pool's run: see the test above
    assert len(results) == 7 and all(r.error is None and r.turns for r in results)
    assert m["preemptions"] > 0 and m["recomputed_tokens"] > 0 and m["admission_waits"] > 0
    assert m["peak_pages"] <= 5 and m["num_pages"] == 5
    with pytest.raises(ValueError, match="cannot hold one episode"):
        Engine(qwen, stop_ids=(), config=EngineConfig(page_size=16, num_pages=2)).run(
            _params(qwen), _sampled_specs(1), jax.random.key(0))


def test_failing_and_sleeping_environments_do_not_stall_or_corrupt_others(qwen, pool_full_run):
    sampled_reference = pool_full_run[0]
    specs = _sampled_specs(7)
    others_done = threading.Event()
    finished = []
    waited = {}

    def wrap(i, step):
        def run(ids, lps, raws):
            out = step(ids, lps, raws)
            if i == 2:
                raise RuntimeError("tool crashed")
            if i == 4 and out is None:  # sleeps until every other episode has finished
                waited["ok"] = others_done.wait(timeout=60)
            if out is None and i != 4:
                finished.append(i)
                if len(finished) == 5:
                    others_done.set()
            return out
        return run

    for i, s in enumerate(specs):
        s.step = wrap(i, s.step)
    engine = _five_slots(qwen, env_workers=3)
    results = engine.run(_params(qwen), specs, jax.random.key(5))
    assert waited["ok"], "the sleeping environment was still waiting: the other episodes stalled behind it"
    assert "tool crashed" in results[2].error and len(results[2].turns) == 1
    assert results[2].turns[0].tolist() == sampled_reference[2].turns[0].tolist()
    assert engine.metrics["env_errors"] == 1
    _same([r for i, r in enumerate(results) if i != 2], [r for i, r in enumerate(sampled_reference) if i != 2])


def test_stop_strings_cut_the_turn_and_rewind_the_cache(qwen, pool_full_run):
    """A stop string cuts a turn right after the token completing its first occurrence;
    the next turn continues from the cut context, as if the tail had never been sampled."""
    decode = lambda ids: "".join(chr(48 + int(i) % 64) for i in ids)  # noqa: E731  (one char per id)
    ref = pool_full_run[0]
    b = next(i for i, r in enumerate(ref) if len(r.turns) > 1 and len(r.turns[0]) >= 4)
    first = ref[b].turns[0].tolist()
    stop = decode(first[1:3])
    cut = next(j for j in range(1, len(first) + 1) if stop in decode(first[:j]))
    specs = _sampled_specs(7)
    engine = Engine(qwen, stop_ids=STOPS, config=EngineConfig(slots=2, page_size=16, num_pages=64, decode_chunk=4,
                                                              prefill_chunk=8), sampling=SAMPLING,
                    stop_strings=(stop,), decode=decode)
    out = engine.run(_params(qwen), specs, jax.random.key(5))
    assert out[b].turns[0].tolist() == first[:cut] and cut < len(first)
    # the cut context, fed from scratch as a first chunk, samples the same next turn
    ctx = list(specs[b].first) + first[:cut] + OBS[0]
    again = engine.run(_params(qwen), [EpisodeSpec(ctx, 48, specs[b].max_turn, _scripted(1, OBS))],
                       jax.random.key(5), first_id=b)
    assert again[0].turns[0].tolist() == out[b].turns[1].tolist()
    with pytest.raises(ValueError, match="need a decode function"):
        Engine(qwen, stop_ids=STOPS, stop_strings=("x",))


def test_input_embeddings_replace_their_positions_and_first_id_names_the_episode(qwen):
    """``EpisodeSpec.embeds`` equal to the ids' own embeddings change nothing; other
    vectors change the first token's log-probs; ``first_id`` shifts the episodes' keys."""
    params = _params(qwen)
    engine = _five_slots(qwen)
    specs = _sampled_specs(3, stop_turns=1)
    plain = engine.run(params, specs, jax.random.key(5))
    table = np.asarray(params["embed"])
    same = [EpisodeSpec(s.first, s.max_total, s.max_turn, s.step, embeds=(1, table[list(s.first[1:2])]))
            for s in specs]
    _same(engine.run(params, same, jax.random.key(5)), plain)
    other = [EpisodeSpec(s.first, s.max_total, s.max_turn, s.step, embeds=(0, table[[5]] * 3.0)) for s in specs]
    moved = engine.run(params, other, jax.random.key(5))
    assert all(abs(a.raw_logprobs[0][0] - b.raw_logprobs[0][0]) > 1e-4 for a, b in zip(moved, plain))
    # episode identities 1, 2 (first_id=1) sample what episodes 1, 2 of the full run sampled
    _same(engine.run(params, specs[1:], jax.random.key(5), first_id=1), plain[1:])
    with pytest.raises(ValueError, match="outside its first chunk"):
        engine.run(params, [EpisodeSpec([3, 4], 48, 4, _scripted(1, OBS), embeds=(1, table[[5, 6]]))],
                   jax.random.key(0))


def test_rollout_trajectories_do_not_depend_on_the_batch_split_or_slots():
    """:func:`lopd_jax.rollout.episodes.rollout` on the tiny policy, sampled: 4 tasks in one call on 4
    slots == the same tasks in two calls of 2 (``first_episode``) on 2 slots, one episode
    in flight at a time; chat format, environments and caps included."""
    from lopd_jax.chat.formats import make_chat_format
    from lopd_jax.envs.synthetic.env import SyntheticTaskSource
    from lopd_jax.programs.evaluate import load_policy
    from lopd_jax.settings.sections import RolloutConfig
    from lopd_jax.rollout.episodes import rollout

    model, tok, _ = load_policy("tiny", seed=1)
    fmt = make_chat_format("qwen3", tok)
    source = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1, seed=3)
    tasks = source.tasks("train")[:4]
    cfg = RolloutConfig(max_turn_tokens=6, max_env_steps=2)
    params = Engine.params_of(model)

    def engine(slots, in_flight):
        return Engine(model, stop_ids=fmt.stop_ids, sampling=SAMPLING, pad_id=tok.pad_token_id,
                      config=EngineConfig(slots=slots, page_size=64, decode_chunk=4, prefill_chunk=64,
                                          max_in_flight=in_flight, env_workers=0))

    whole = rollout(engine(4, 0), params, fmt, source.make_env, tasks, jax.random.key(3), cfg)
    e2 = engine(2, 1)
    split = [t for i in (0, 2) for t in rollout(e2, params, fmt, source.make_env, tasks[i:i + 2],
                                                jax.random.key(3), cfg, first_episode=i)]
    for a, b in zip(whole, split):
        assert a.tokens.tolist() == b.tokens.tolist() and a.mask.tolist() == b.mask.tolist()
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert (a.reward, a.finish_reason, a.turn_lengths) == (b.reward, b.finish_reason, b.turn_lengths)
    assert all(np.all(t.logprobs[t.mask > 0] < 0) for t in whole)  # sampled, not greedy
    assert rollout(e2, params, fmt, source.make_env, [], jax.random.key(3), cfg) == []


def test_evaluate_samples_the_same_trajectories_at_any_batch_size(tmp_path):
    """``python -m lopd_jax.evaluate --temperature=1 --seed=S`` with ``--batch_size=2`` and
    ``--batch_size=6`` (and so 2 and 6 slots): the same episodes, task by task."""
    import json

    from lopd_jax.programs.evaluate import main

    outs = []
    for bs in (2, 6):
        out = tmp_path / f"bs{bs}.json"
        assert main(["--model=tiny", "--split=train", "--num_tasks=6", "--max_steps=2", "--max_turn_tokens=6",
                     "--max_total_tokens=2048", "--temperature=1", "--seed=3", f"--batch_size={bs}",
                     f"--out={out}"]) == 0
        outs.append(json.loads(out.read_text())["trajectories"])
    keys = ("task_id", "turn_ids", "turn_lengths", "finish_reason", "reward", "num_turns")
    assert [[t[k] for k in keys] for t in outs[0]] == [[t[k] for k in keys] for t in outs[1]]
    np.testing.assert_allclose([t["mean_raw_logprob"] for t in outs[0]], [t["mean_raw_logprob"] for t in outs[1]],
                               atol=1e-5)
    assert len({t["mean_raw_logprob"] for t in outs[0]}) == 6  # sampled, distinct episodes
    assert [[len(ids) for ids in t["turn_ids"]] for t in outs[0]] == [t["turn_lengths"] for t in outs[0]]




def test_a_feed_streams_episodes_with_their_own_keys_and_swaps_weights_in_flight(qwen, pool_full_run):
    """Episodes given by a feed in two groups, each with the run's key as its own, sample
    what one plain run samples; new weights given with the second group reach the first
    group's episodes in flight, and every token records its weights' version."""
    from lopd_jax.rollout.engine_calls import key_data
    keyed = lambda specs, first: [dataclasses.replace(s, identity=first + i, rng=key_data(jax.random.key(5)))
                                  for i, s in enumerate(specs)]
    specs = _sampled_specs(7)
    feed = ScriptedFeed([keyed(specs[:4], 0), keyed(specs[4:], 4)])
    engine = _five_slots(qwen, env_workers=0)
    assert engine.run(_params(qwen), [], jax.random.key(99), feed=feed) == []
    _same([feed.results[i] for i in range(7)], pool_full_run[0])
    assert all(len(v) == len(t) and not v.any() for r in feed.results.values() for v, t in zip(r.versions, r.turns))
    assert engine.metrics["leaked_pages"] == 0 and "weight_swaps" not in engine.metrics

    other = jax.tree.map(lambda x: x * 1.5, _params(qwen))
    specs = _sampled_specs(7)
    feed = ScriptedFeed([keyed(specs[:4], 0), keyed(specs[4:], 4)], swaps={1: (other, 1)})
    engine.run(_params(qwen), [], jax.random.key(99), feed=feed)
    assert engine.metrics["weight_swaps"] == 1
    first = [feed.results[i].version_range() for i in range(4)]
    assert all(feed.results[i].version_range() == (1, 1) for i in range(4, 7))
    assert (0, 1) in first and all(lo <= hi for lo, hi in first)  # went on under the new weights
    for i in range(4):  # tokens sampled before the swap are the plain run's
        r, ref = feed.results[i], pool_full_run[0][i]
        old = int((r.versions[0] == 0).sum())
        assert r.turns[0][:old].tolist() == ref.turns[0][:old].tolist()
    assert any(feed.results[i].context != pool_full_run[0][i].context for i in range(7))


@pytest.mark.parametrize("env_workers", [0, 2])
def test_a_feed_can_drop_episodes_in_flight(qwen, env_workers):
    """Episodes a feed drops (a restart) leave wherever they are, with their pages; the
    others finish as in a plain run."""
    specs = [dataclasses.replace(x, identity=i) for i, x in enumerate(_sampled_specs(7))]
    feed = ScriptedFeed([specs], drop_on_first_end=specs[3:5])  # given when the first episode ends
    engine = _five_slots(qwen, env_workers=env_workers)
    engine.run(_params(qwen), [], jax.random.key(5), feed=feed)
    dropped = {3, 4} - set(feed.results)  # one may have ended before the engine took the drops
    assert dropped and engine.metrics["dropped_episodes"] == len(dropped)
    assert set(feed.results) == set(range(7)) - dropped and engine.metrics["leaked_pages"] == 0


def test_a_feed_can_cancel_the_run_and_must_not_leave_the_engine_idle(qwen):
    engine = _five_slots(qwen, env_workers=0)
    feed = ScriptedFeed([_sampled_specs(7)], cancel_after=1)
    engine.run(_params(qwen), [], jax.random.key(1), feed=feed)
    assert len(feed.results) == 1 and engine.metrics["cancelled_episodes"] == 6
    assert engine.metrics["leaked_pages"] == 0
    with pytest.raises(RuntimeError, match="must block"):
        engine.run(_params(qwen), [], jax.random.key(1), feed=ScriptedFeed([_sampled_specs(2), _sampled_specs(2)],
                                                                    idle_gap=True))
