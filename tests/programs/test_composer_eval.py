"""Base + Composer evaluation: latent-conditioned rollouts and ``evaluate --composer_from``.

* A rollout with a :class:`lopd_jax.rollout.episodes.LatentContext` whose latents are the embeddings of
  the slot token equals plain sampling of the teacher-format prompt ids (block inserted at
  the first user message's content): the splice is at the right place and really used;
  other latents change the log-probs; trajectories keep the student's ids.
* ``python -m lopd_jax.evaluate --composer_from=<run>`` on the tiny end-to-end run loads
  theta0, the composer and the bank, and its log-probs differ from the same base policy
  without latents.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.method.composer import LatentFraming
from lopd_jax.envs.synthetic.env import SyntheticTaskSource
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.chat.tokenizers import tiny_tokenizer
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.episode_spec import EpisodeSpec
from lopd_jax.settings.sections import EngineConfig, RolloutConfig, SamplingParams
from lopd_jax.rollout.episodes import LatentContext, rollout

GREEDY = SamplingParams(temperature=0.0)


def test_latent_rollout_equals_known_token_prompt_and_latents_matter():
    from lopd_jax.programs.evaluate import load_policy

    tok = tiny_tokenizer("qwen3")
    fmt = make_chat_format("qwen3", tok)
    source = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1, seed=3)
    tasks = source.tasks("train")[:3]
    model, _, _ = load_policy("tiny", seed=1)
    block = fmt.framing_ids(LatentFraming(num_slots=6))
    layout = SpliceLayout(block.before_ids, block.after_ids, block.num_slots, block.slot_id)
    engine = Engine(model, stop_ids=fmt.stop_ids, sampling=GREEDY, pad_id=tok.pad_token_id,
                    config=EngineConfig(slots=3, page_size=64, decode_chunk=4, prefill_chunk=128))
    params = Engine.params_of(model)
    cfg = RolloutConfig(max_env_steps=1, max_turn_tokens=12)
    known = jnp.broadcast_to(params["embed"][layout.slot_id], (len(tasks), layout.num_slots, model.cfg.hidden_size))
    key = jax.random.key(0)
    with_known = rollout(engine, params, fmt, source.make_env, tasks, key, cfg, latents=LatentContext(layout, known))
    # reference: plain sampling of the teacher-format prompts (the block's ids in the text)
    prompts, inserts = [], []
    for t in tasks:
        p = fmt.prompt_ids(*source.make_env().reset(t))
        prompts.append(p)
        inserts.append(fmt.insertion_point(p))
    teacher = LatentContext(layout, known).first_chunks(prompts, inserts)
    assert [len(x) - len(p) for x, p in zip(teacher, prompts)] == [layout.length] * 3
    ref = engine.run(params, [EpisodeSpec(t, 4096, 12, lambda *_: None) for t in teacher], key)
    for b, traj in enumerate(with_known):
        n = len(prompts[b])
        gen, raw = ref[b].turns[0], ref[b].raw_logprobs[0]
        assert traj.tokens[:n].tolist() == prompts[b] and traj.insert_at == inserts[b]  # student-format ids
        assert traj.tokens[n:n + len(gen)].tolist() == gen.tolist()
        np.testing.assert_allclose(traj.raw_logprobs[n:n + len(gen)], raw, atol=1e-5)
    # other latents: a different conditioning, so different log-probs of the first token
    rnd = jax.random.normal(jax.random.key(7), known.shape) * 0.5
    with_rnd = rollout(engine, params, fmt, source.make_env, tasks, key, cfg, latents=LatentContext(layout, rnd))
    plain = rollout(engine, params, fmt, source.make_env, tasks, key, cfg)
    for a, b, c in zip(with_rnd, with_known, plain):
        n = int(np.flatnonzero(a.mask)[0])
        assert abs(a.raw_logprobs[n] - b.raw_logprobs[n]) > 1e-4 and abs(a.raw_logprobs[n] - c.raw_logprobs[n]) > 1e-4
    with pytest.raises(ValueError, match="latents for 2 tasks"):
        rollout(engine, params, fmt, source.make_env, tasks, key, cfg, latents=LatentContext(layout, rnd[:2]))


@pytest.mark.process
def test_evaluate_composer_from_run(tmp_path_factory, tmp_path):
    from lopd_jax.programs.composer_eval import latent_context, load_composer_run
    from lopd_jax.programs.evaluate import main, parse_args
    from tests.train.test_train_e2e import ensure_full_run

    workdir, _ = ensure_full_run(tmp_path_factory)
    for bad in ([f"--composer_from={tmp_path}"], [f"--composer_from={workdir}", "--model=tiny"],
                [f"--composer_from={workdir}", "--env=synthetic"], [f"--composer_from={workdir}", "--env_kwargs={}"],
                []):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
    common = ["--split=heldout", "--num_tasks=2", "--max_steps=2", "--max_turn_tokens=16", "--batch_size=2",
              "--temperature=0"]
    out = tmp_path / "composer.json"
    assert main([f"--composer_from={workdir}", f"--out={out}", *common]) == 0
    result = json.loads(out.read_text())
    assert result["metrics"]["composer"]["stage"] == "lopd" and result["metrics"]["composer"]["step"] == 3
    assert result["metrics"]["num_trajectories"] == 2
    # the same base policy without latents: the composer's latents change the log-probs
    run = load_composer_run(workdir, "cold_start")
    assert run.stage == "cold_start" and run.step == 2
    tasks = run.ctx.source.tasks("heldout")[:2]
    lc = latent_context(run, tasks)
    assert lc.latents.shape == (2, run.ctx.layout.num_slots, run.ctx.model_cfg.hidden_size)
    assert float(jnp.abs(lc.latents).mean()) > 0
    cfg = RolloutConfig(max_env_steps=1, max_turn_tokens=4)
    key = jax.random.key(0)
    base = rollout(run.ctx.engine, run.base_params(), run.ctx.fmt, run.ctx.source.make_env, tasks, key, cfg, GREEDY)
    comp = rollout(run.ctx.engine, run.base_params(), run.ctx.fmt, run.ctx.source.make_env, tasks, key, cfg, GREEDY,
                   latents=lc)
    for a, b in zip(base, comp):
        n = int(np.flatnonzero(a.mask)[0])
        assert abs(a.raw_logprobs[n] - b.raw_logprobs[n]) > 1e-5
