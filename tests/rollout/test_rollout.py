"""Multi-turn rollout through the synthetic environment with a scripted policy.

The policy is a model whose greedy choice is the next id of whichever oracle script the
context (read back from its own paged KV cache) is a prefix of, else the end-of-turn id.
The engine (slots, pages, cache reuse across turns), chat format and environment all run
for real, so the tests check rewards, supervision masks and that the trajectory ids are
exactly the sampled ids plus the observation ids (no re-tokenization).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.envs.synthetic.env import SyntheticTaskSource, oracle_turns
from lopd_jax.method.eval_stats import behaviour_stats
from lopd_jax.chat.tokenizers import tiny_tokenizer
from lopd_jax.core.types import AssistantTurn
from lopd_jax.rollout.engine import Engine
from lopd_jax.settings.sections import EngineConfig, RolloutConfig, SamplingParams
from lopd_jax.rollout.episodes import rollout, training_arrays


class _Shape(NamedTuple):
    """The page-pool shape of :class:`ScriptedLM` (one layer, one "KV head" of width 1)."""

    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    jnp_dtype: Any = jnp.float32


class ScriptedLM(nnx.Module):
    """Greedy-decodes the continuation of the script matching the context (see module doc).

    Keeps the token ids themselves in its page pool ([pages, page_size, 2, 1]; the engine's
    own paged cache); hidden states are scaled one-hot vectors of the chosen next id and
    the LM head is the identity.
    """

    def __init__(self, scripts, vocab: int, fallback: int):
        width = max(len(s) for s in scripts) + 1
        table = np.full((len(scripts), width), -1, np.int32)
        for i, s in enumerate(scripts):
            table[i, : len(s)] = s
        self.scripts = nnx.Variable(jnp.asarray(table))
        self.vocab, self.fallback = vocab, fallback
        self.cfg = _Shape()

    def lm_head_kernel(self):
        return jnp.eye(self.vocab, dtype=jnp.float32)

    def embed_tokens(self, ids):
        return jax.nn.one_hot(ids, self.vocab)

    def paged_forward(self, input_ids, positions, valid, kv_lens, pools, page_table, num_pages, inputs_embeds=None):
        """The engine's forward (:func:`lopd_jax.rollout.engine._forward`): write the ids into the rows'
        pages, read each row's context back, pick the next script id per query."""
        B = input_ids.shape[0]
        pool = pools[0][:, :, 0, 0]  # [P, page_size]
        P, ps = pool.shape
        page = jnp.take_along_axis(page_table, jnp.minimum(positions // ps, page_table.shape[1] - 1), axis=1)
        pool = pool.at[jnp.where(valid, page, P), positions % ps].set(input_ids.astype(jnp.float32), mode="drop")
        ctx = pool[page_table[:, :num_pages]].reshape(B, num_pages * ps)
        T = ctx.shape[1]
        table = self.scripts[...]
        table = jnp.pad(table, ((0, 0), (0, max(0, T + 1 - table.shape[1]))), constant_values=-1)
        prefix_ok = jnp.cumprod(ctx[:, None, :] == table[None, :, :T].astype(jnp.float32), axis=-1)  # [B, n, T]
        match = jnp.take_along_axis(prefix_ok, jnp.broadcast_to(positions[:, None], (B, table.shape[0],
                                                                                      positions.shape[1])), axis=2)
        which = jnp.argmax(match, axis=1)  # [B, S]
        nxt = table[which, positions + 1]
        tok = jnp.where((match.max(axis=1) > 0) & (nxt >= 0), nxt, self.fallback)
        hidden = 40.0 * jax.nn.one_hot(tok, self.vocab)
        return hidden, (jnp.broadcast_to(pool[:, :, None, None], pools[0].shape),)


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer("qwen3")
    fmt = make_chat_format("qwen3", tok)
    source = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1, seed=3)
    tasks = source.tasks("train")[:5]
    return fmt, source, tasks


def oracle_script(fmt, source, task, turns=None, turn_cap=None):
    """(ids, mask, reward, n_turns) of the oracle policy, built by stepping a fresh env by hand."""
    env = source.make_env()
    messages, tools = env.reset(task)
    ids = fmt.prompt_ids(messages, tools)
    mask = [0] * len(ids)
    reward, n = None, 0
    for turn in turns if turns is not None else oracle_turns(task):
        gen = fmt.encode(turn.raw) + [fmt.end_of_turn_id]
        if turn_cap is not None:
            gen = gen[:turn_cap]
        ids, mask, n = ids + gen, mask + [1] * len(gen), n + 1
        result = env.step(fmt.parse_generated(gen))
        if result.done:
            reward = result.reward
            break
        obs = fmt.observation_ids(result.observation, turn_closed=gen[-1] == fmt.end_of_turn_id)
        ids, mask = ids + obs, mask + [0] * len(obs)
    return ids, mask, reward, n, env


def _engine(fmt, scripts, env_workers=0):
    model = ScriptedLM(scripts, len(fmt.tokenizer), fmt.end_of_turn_id)
    engine = Engine(model, stop_ids=fmt.stop_ids, sampling=SamplingParams(temperature=0.0),
                    config=EngineConfig(slots=4, page_size=64, decode_chunk=8, prefill_chunk=256,
                                        env_workers=env_workers))
    return engine, Engine.params_of(model)


def test_oracle_policy_gets_full_reward_with_exact_ids_and_mask(setup):
    fmt, source, tasks = setup
    expected = [oracle_script(fmt, source, t) for t in tasks]
    assert all(e[2] == 1.0 for e in expected) and len({e[3] for e in expected}) > 1
    engine, params = _engine(fmt, [e[0] for e in expected], env_workers=2)
    trajs = rollout(engine, params, fmt, source.make_env, tasks, jax.random.key(0),
                    RolloutConfig(max_turn_tokens=64))
    for traj, (ids, mask, reward, n_turns, _), task in zip(trajs, expected, tasks):
        assert traj.tokens.tolist() == ids  # sampled ids + observation ids, never re-tokenized
        assert traj.mask.tolist() == mask
        assert traj.reward == reward == 1.0 and traj.finish_reason == "done"
        assert traj.num_turns == n_turns == len(oracle_turns(task))
        assert traj.tokens[traj.insert_at:].tolist()[:3] == fmt.encode(task.instruction)[:3]
        assert np.all(traj.logprobs == 0) and np.all(np.abs(traj.raw_logprobs) < 1e-6)
        calls = [m["tool_calls"][0]["function"] for m in traj.messages if m.get("tool_calls")]
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.name, c.arguments) for t in oracle_turns(task) for c in t.tool_calls]
        assert traj.env_stats["tool_calls"] == len(calls)
        assert traj.turn_lengths == [len(fmt.encode(t.raw)) + 1 for t in oracle_turns(task)]
    arrays = training_arrays(trajs, buckets=(1536, 2048))
    S = arrays["tokens"].shape[1]
    assert S in (1536, 2048) and arrays["tokens"].shape == (len(tasks), S)
    for b, traj in enumerate(trajs):
        n = len(traj)
        assert arrays["attention_mask"][b].sum() == n and arrays["mask"][b].sum() == traj.mask.sum()
        assert arrays["tokens"][b, :n].tolist() == traj.tokens.tolist()
    np.testing.assert_array_equal(arrays["insert_at"], [t.insert_at for t in trajs])
    stats = behaviour_stats(trajs)
    assert stats["success_rate"] == 1.0 and stats["mean_reward"] == 1.0
    assert stats["mean_env_steps"] == np.mean([e[3] for e in expected])


def test_turn_cap_truncates_and_supplies_end_of_turn_unmasked(setup):
    fmt, source, tasks = setup
    task = next(t for t in tasks if len(oracle_turns(t)) >= 2)
    cap = 8
    # expected: the first oracle turn cut to 8 ids (parse error), then the policy is off its
    # script and answers with an empty turn (just the end-of-turn id)
    turns = [oracle_turns(task)[0], AssistantTurn(raw="", content="")]
    ids, mask, reward, n, _ = oracle_script(fmt, source, task, turns=turns, turn_cap=cap)
    full = oracle_script(fmt, source, task)[0]
    engine, params = _engine(fmt, [full])
    (traj,) = rollout(engine, params, fmt, source.make_env, [task], jax.random.key(0),
                      RolloutConfig(max_turn_tokens=cap))
    assert traj.tokens.tolist() == ids and traj.mask.tolist() == mask
    first = mask.index(1)
    assert traj.tokens[first + cap] == fmt.end_of_turn_id and traj.mask[first + cap] == 0
    assert traj.turn_lengths == [cap, 1] and traj.reward == reward < 1.0
    assert traj.env_stats["parse_errors"] == 1


def test_step_and_total_caps_score_with_finish(setup):
    fmt, source, tasks = setup
    multi = [t for t in tasks if len(oracle_turns(t)) >= 2][:2]
    scripts = [oracle_script(fmt, source, t)[0] for t in multi]
    engine, params = _engine(fmt, scripts)
    trajs = rollout(engine, params, fmt, source.make_env, multi, jax.random.key(0),
                    RolloutConfig(max_env_steps=1, max_turn_tokens=64))
    for traj, task in zip(trajs, multi):
        ids, mask, _, _, env = oracle_script(fmt, source, task, turns=oracle_turns(task)[:1])
        n_gen = len(fmt.encode(oracle_turns(task)[0].raw)) + 1
        cut = mask.index(1) + n_gen
        assert traj.finish_reason == "max_steps" and traj.num_turns == 1
        assert traj.tokens.tolist() == ids[:cut] and traj.reward == env.finish()
    # total-token cap: the first turn is cut 5 tokens in and never reaches the environment
    task = multi[0]
    prompt_len = oracle_script(fmt, source, task)[1].index(1)
    (traj,) = rollout(engine, params, fmt, source.make_env, [task], jax.random.key(0),
                      RolloutConfig(max_total_tokens=prompt_len + 5, max_turn_tokens=64))
    fresh = source.make_env()
    fresh.reset(task)
    assert traj.finish_reason == "max_tokens" and len(traj) == prompt_len + 5
    assert traj.tokens.tolist() == scripts[0][: prompt_len + 5] and traj.mask.sum() == 5
    assert traj.env_stats["turns"] == 0 and traj.reward == fresh.finish()


def test_real_model_rollout_logprobs_align_with_training_forward(setup):
    fmt, source, tasks = setup
    from lopd_jax.programs.evaluate import load_policy
    from lopd_jax.method.losses import chunked_token_logp

    model, tok, _ = load_policy("tiny", seed=1)
    engine = Engine(model, stop_ids=fmt.stop_ids, sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=50),
                    config=EngineConfig(slots=2, page_size=64, decode_chunk=8), pad_id=tok.pad_token_id)
    trajs = rollout(engine, Engine.params_of(model), fmt, source.make_env, tasks[:2], jax.random.key(2),
                    RolloutConfig(max_turn_tokens=8))
    arrays = training_arrays(trajs, length=1280)
    ids = jnp.asarray(arrays["tokens"])
    h = jax.jit(lambda x: model(x, attention_mask=x >= 0, return_hidden=True))(ids)
    ref = np.asarray(chunked_token_logp(h[:, :-1], model.lm_head_kernel(), ids[:, 1:], chunk_size=256))
    for b, traj in enumerate(trajs):
        gen = np.flatnonzero(traj.mask)
        prompt_len = len(fmt.prompt_ids(*source.make_env().reset(traj.task)))
        assert len(gen) == sum(traj.turn_lengths) > 0 and gen[0] == prompt_len
        np.testing.assert_allclose(traj.raw_logprobs[gen], ref[b, gen - 1], atol=1e-4)
        assert np.all(traj.logprobs[traj.mask == 0] == 0) and np.all(traj.logprobs[gen] <= 0)
        assert np.all(traj.logprobs[gen] > -np.inf)


def test_evaluate_command(tmp_path):
    from lopd_jax.programs.evaluate import main, parse_args

    for bad in (["--model=/no/such/dir"], ["--model=tiny", "--top_p=0"], ["--model=tiny", "--env=nope"],
                ["--model=tiny", "--num_tasks=0"], ["--model=tiny", "--env_kwargs={bad"],
                ["--model=tiny", f"--out={tmp_path}/missing/x.json"]):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
    assert main(["--model=tiny", "--env_kwargs={\"no_such_option\": 1}"]) == 2
    out = tmp_path / "eval.json"
    rc = main(["--model=tiny", "--env_kwargs={\"n_train_per_family\": 1, \"n_heldout_per_family\": 1}",
               "--num_tasks=2", "--max_turn_tokens=8", "--batch_size=2", f"--out={out}"])
    assert rc == 0
    import json
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert m["num_trajectories"] == 2 and len(result["trajectories"]) == 2
    assert 0.0 <= m["mean_reward"] <= 1.0 and 0.0 <= m["success_rate"] <= 1.0
    assert 1 <= m["first_response_tokens"] <= 8 and m["mean_env_steps"] >= 1
    for key in ("tool_calls_per_step", "repeated_calls", "reward_per_call", "finish_reasons"):
        assert key in m
