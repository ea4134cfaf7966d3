"""Baseline arms: GRPO against a NumPy reference, the text-context teacher sequences of
OPSD / SDPO / SDFT / Skill-SD / experiences as text, UCB1, and the equal-budget / arm config plumbing."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lopd_jax.method.composer import ComposerConfig
from lopd_jax.settings.errors import ConfigError
from configs import load_config
from lopd_jax.settings.overrides import apply_overrides
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.method.text_context import align_teacher_hidden, context_block_ids, pack_blocks, text_teacher_inputs
from models.config import LoraConfig, named_config
from models.decoder import Decoder
from train.system import LOPDSystem
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import StepConfig

COMPOSER = ComposerConfig(num_latents=2, depth=1, n_ret=1, lora=LoraConfig(rank=4, alpha=8.0))
LAYOUT = SpliceLayout(before_ids=(11, 12), after_ids=(14,), num_slots=2, slot_id=7)
G, B, S = 4, 8, 16


def _system(**step):
    cfg = named_config("tiny_qwen3", lora=COMPOSER.lora)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                                for x, k in zip(leaves, keys)]))
    return LOPDSystem.create(model, COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8, top_m=4), **step))


def _np_logp(system, params, tokens, amask):
    """log pi(tokens[:, 1:]) from the full-vocabulary logits, in NumPy."""
    _, lora0, _ = system.initial_params()
    logits = np.asarray(system.backbone(params, lora0)(jnp.asarray(tokens), attention_mask=jnp.asarray(amask)),
                        np.float64)[:, :-1]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]


def _grpo_reference(new, old, rewards, mask, eps=0.2):
    r = rewards.reshape(-1, G).astype(np.float64)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    ratio = np.exp(new - old)
    per = -np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps) * adv[:, None])
    m = mask > 0
    return per[m].mean(), ratio[m].mean()


def test_grpo_loss_and_ratio_match_numpy():
    from train.steps import grpo_loss, make_grpo_step
    system = _system()
    state, frozen = system.init_state(seed=0)
    rng = np.random.RandomState(0)
    tokens = rng.randint(16, 512, (B, S)).astype(np.int32)
    amask = np.arange(S)[None] < rng.randint(10, S + 1, (B, 1))
    loss_mask = ((np.arange(S)[None] >= 5) & amask).astype(np.float32)
    rewards = np.array([1, 0, 0.5, 1, 0, 0, 0.25, 1], np.float32)
    new = _np_logp(system, state["student"], tokens, amask)
    mask = loss_mask[:, 1:]
    # old_logp aligned with tokens (entry j = log-prob of tokens[j]) as the sampler writes it
    for noise in (0.0, 0.3):
        old = new + noise * rng.standard_normal(new.shape)
        batch = {"tokens": tokens, "attention_mask": amask, "loss_mask": loss_mask, "rewards": rewards,
                 "old_logp": np.concatenate([np.zeros((B, 1)), old], 1).astype(np.float32)}
        loss, m = jax.jit(lambda st, b: grpo_loss(system, st["student"], st, frozen, b, G))(state, batch)
        ref_loss, ref_ratio = _grpo_reference(new, old, rewards, mask)
        np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(float(m["ratio_mean"]), ref_ratio, rtol=2e-4)
        if noise == 0.0:  # one update per batch: the ratio is exactly 1
            assert float(m["ratio_max_dev"]) < 1e-4 and float(m["clip_fraction"]) == 0.0
    step = make_grpo_step(system, state, batch, group_size=G)
    new_state, metrics = step(state, frozen, batch)
    assert float(metrics["student_grad_norm"]) > 0 and int(new_state["step"]) == 1


def test_text_teacher_inputs_put_exact_block_at_the_slot():
    rng = np.random.RandomState(1)
    tokens = rng.randint(16, 500, (4, 12)).astype(np.int32)
    lengths = np.array([12, 9, 7, 12])
    amask = np.arange(12)[None] < lengths[:, None]
    insert_at = np.array([2, 3, 0, 5], np.int32)
    blocks = [[501, 502, 503], [504], None, [505, 506, 507, 508, 509]]
    ctx_ids, ctx_len = pack_blocks(blocks, 6, pad_id=0)
    ids, mask = (np.asarray(x) for x in text_teacher_inputs(tokens, amask, insert_at, ctx_ids, ctx_len))
    for b in range(4):
        a, n, L = insert_at[b], ctx_len[b], lengths[b]
        want = list(tokens[b, :a]) + list(blocks[b] or []) + list(tokens[b, a:L])
        assert list(ids[b, :L + n]) == want
        assert mask[b].tolist() == [True] * (L + n) + [False] * (12 + 6 - L - n)
    # alignment: the teacher position of student token j holds the same token
    hid = jnp.asarray(ids, jnp.float32)[..., None]
    back = np.asarray(align_teacher_hidden(hid, insert_at, ctx_len, 12))[..., 0]
    for b in range(4):
        np.testing.assert_array_equal(back[b, :lengths[b]], tokens[b, :lengths[b]])


def test_text_teacher_hidden_equals_unpadded_forward():
    """Right padding and the in-row block give the same hidden states as the row alone."""
    system = _system()
    frozen = system.initial_params()[0]
    model = system.backbone(frozen, system.initial_params()[1])
    rng = np.random.RandomState(2)
    tokens = rng.randint(16, 500, (2, 10)).astype(np.int32)
    amask = np.arange(10)[None] < np.array([[10], [7]])
    ins = np.array([3, 1], np.int32)
    ctx_ids, ctx_len = pack_blocks([[600, 601, 602, 603], [604, 605]], 5)
    ids, mask = text_teacher_inputs(tokens, amask, ins, ctx_ids, ctx_len)
    hid = align_teacher_hidden(model(ids, attention_mask=mask, return_hidden=True), ins, ctx_len, 10)
    for b, blk in enumerate(([600, 601, 602, 603], [604, 605])):
        L = int(amask[b].sum())
        row = np.array(list(tokens[b, :ins[b]]) + blk + list(tokens[b, ins[b]:L]))[None]
        ref = np.asarray(model(jnp.asarray(row), return_hidden=True))[0]
        j = np.arange(ins[b], L)
        np.testing.assert_allclose(np.asarray(hid)[b, j], ref[j + len(blk)], atol=1e-5)


# ----------------------------------------------------------------------------- per-arm contexts


@functools.lru_cache(maxsize=1)
def _source_and_tokenizer():
    from lopd_jax.envs.registry import get_task_source
    from lopd_jax.chat.tokenizers import tiny_tokenizer
    source = get_task_source("synthetic", n_train_per_family=2, n_heldout_per_family=1, seed=0,
                             tool_descriptions=False)
    return source, tiny_tokenizer("qwen3")


def _arm_ctx(arm):
    cfg = apply_overrides(load_config("tiny"), [f"arm={arm}", "arms.context_tokens=400", "env.tasks_per_step=8"])
    source, tok = _source_and_tokenizer()
    return types.SimpleNamespace(cfg=cfg, source=source, train_tasks=source.tasks("train"), tokenizer=tok,
                                 seq_buckets=lambda: (128,))


def _traj(task, reward, tok):
    from lopd_jax.envs.synthetic.env import oracle_calls
    from lopd_jax.rollout.episodes import Trajectory
    calls, answer = oracle_calls(task)
    msgs = [{"role": "user", "content": task.instruction}]
    for c in calls:
        msgs += [{"role": "assistant", "content": "", "tool_calls": [c.to_message_field()]},
                 {"role": "tool", "content": "ok"}]
    msgs.append({"role": "assistant", "content": answer})
    ids = np.asarray(tok.encode("user: " + task.instruction + " assistant: " + answer)[:100], np.int32)
    mask = np.zeros(len(ids), np.int32)
    mask[len(ids) // 2:] = 1
    z = np.zeros(len(ids), np.float32)
    return Trajectory(task=task, tokens=ids, mask=mask, logprobs=z, raw_logprobs=z, messages=msgs, tools=[],
                      reward=reward, env_stats={}, num_turns=1, turn_lengths=[1], insert_at=2, finish_reason="done")


def _check_rows(impl, ctx, batch, trajs, texts):
    """Every row's teacher ids = student prefix + exactly the arm's block of ``texts[b]`` + rest."""
    ids, mask = (np.asarray(x) for x in text_teacher_inputs(batch["tokens"], batch["attention_mask"],
                                                             batch["insert_at"], batch["ctx_ids"], batch["ctx_len"]))
    for b, (t, text) in enumerate(zip(trajs, texts)):
        block = [] if text is None else context_block_ids(ctx.tokenizer, impl.framing, text,
                                                          ctx.cfg.arms.context_tokens)
        assert batch["row_weight"][b] == (text is not None)
        n, a = len(t.tokens), t.insert_at
        assert list(ids[b, :n + len(block)]) == list(t.tokens[:a]) + block + list(t.tokens[a:])
        if text is not None:
            before, _ = impl.framing
            assert ctx.tokenizer.decode(block).startswith(before) and text in ctx.tokenizer.decode(block)


@pytest.mark.parametrize("arm", ["opsd", "sdpo", "sdft", "skill_sd"])
def test_text_arm_contexts(arm):
    from train.arms.registry import arm_class
    from train.bank_stage import to_experience
    from lopd_jax.method.text_context import skill_summary, trajectory_text
    ctx = _arm_ctx(arm)
    tasks = ctx.train_tasks
    groups = [tasks[0]] * 4 + [tasks[2]] * 4  # two groups of G = 4
    rewards = [0.5, 1.0, 0.0, 1.0, 0.5, 0.0, 0.25, 0.0] if arm == "sdpo" else [1.0] * 8
    trajs = [_traj(t, r, ctx.tokenizer) for t, r in zip(groups, rewards)]
    bank = types.SimpleNamespace(entries=[to_experience(_traj(t, 1.0, ctx.tokenizer)) for t in tasks[:6]])
    impl = arm_class(arm)(ctx, bank)
    batch = impl.batch(3, trajs)
    if arm == "opsd":
        texts = [ctx.source.oracle_hint(t.task) for t in trajs]
    elif arm == "sdpo":  # rows 0, 2 -> sibling 1 (the next success); 1 -> 3; 3 -> 1; group 2 has no success
        sib = {0: 1, 1: 3, 2: 3, 3: 1}
        texts = [trajectory_text(to_experience(trajs[sib[i]]), ctx.cfg.bank.max_obs_chars) for i in range(4)]
        texts += [None] * 4
    elif arm == "sdft":
        texts = impl.contexts(3, trajs)
        for t, x in zip(trajs, texts):
            others = [o for o in tasks if o.family == t.task.family and o.task_id != t.task.task_id]
            assert any(x == f"Task: {o.instruction}\nSolution:\n{ctx.source.oracle_hint(o)}" for o in others)
    else:  # the first untried skill of the row's family (UCB1 tries every arm once first)
        skills = [skill_summary(e) for e in bank.entries]
        fam = {e.info["family"]: skill_summary(e) for e in reversed(bank.entries)}
        texts = [fam[t.task.family] for t in trajs]
        assert all(x in skills for x in texts)
    _check_rows(impl, ctx, batch, trajs, texts)


def test_experiences_text_context_is_the_retrieved_experiences():
    """``experiences_text``: every row's teacher block holds, in retrieval order, the
    ``composer.n_ret`` experiences the bank retrieves for its task -- the ones LOPD's batch
    hands the composer (:func:`train.batches.retrieved_experience_arrays`) -- as text."""
    from lopd_jax.method.bank import ExperienceBank
    from lopd_jax.method.embedders import HashingEmbedder
    from lopd_jax.method.text_context import trajectory_text
    from train.arms.registry import arm_class
    from train.bank_stage import to_experience
    ctx = _arm_ctx("experiences_text")
    ctx.cfg = apply_overrides(ctx.cfg, ["composer.n_ret=2", "arms.context_tokens=2000"])
    tasks = ctx.train_tasks
    bank = ExperienceBank(HashingEmbedder(dim=256), ctx.cfg.bank_config())  # the run's retrieval, n_ret = 2
    bank.add_many([to_experience(_traj(t, 1.0, ctx.tokenizer)) for t in tasks])
    bank.build()
    trajs = [_traj(t, r, ctx.tokenizer) for t, r in zip([tasks[0]] * 4 + [tasks[3]] * 4, [0.0, 1.0] * 4)]
    impl = arm_class("experiences_text")(ctx, bank)
    batch = impl.batch(5, trajs)
    texts = impl.contexts(5, trajs)
    for t, text in zip(trajs, texts):
        exps = bank.retrieve([t.task.instruction], [t.task.task_id])[0]
        assert len(exps) == 2
        lines = [trajectory_text(e, ctx.cfg.bank.max_obs_chars) for e in exps]
        assert text == f"Example 1:\n{lines[0]}\n\nExample 2:\n{lines[1]}"
        assert all(e.instruction in text for e in exps)
    _check_rows(impl, ctx, batch, trajs, texts)


def test_ucb1_tries_each_then_exploits():
    from train.arms.skill_sd import UCB1
    u = UCB1(3, c=0.1)
    assert [u.select([0, 1, 2]) for _ in range(1)] == [0]
    for k, r in ((0, 0.1), (1, 0.9), (2, 0.2)):
        u.update(k, r)
    assert u.select([0, 1, 2]) == 1
    s = u.state()
    v = UCB1(3, c=0.1)
    v.set_state(s)
    assert v.select([0, 2]) == 2


def test_arm_config_and_equal_budget():
    from lopd_jax.settings.arm_config import group_size, resolve_arm, rollouts_per_step
    base = load_config("tiny")
    frozen = resolve_arm(apply_overrides(base, ["arm=lopd_frozen_composer"]))
    assert frozen.steps.freeze_composer
    grpo = resolve_arm(apply_overrides(base, ["arm=grpo"]))
    assert group_size(grpo) == 4 and rollouts_per_step(grpo) == rollouts_per_step(base) == 8
    with pytest.raises(ConfigError, match="arm"):
        apply_overrides(base, ["arm=ppo"])
    with pytest.raises(ConfigError, match="group_size"):
        resolve_arm(apply_overrides(base, ["arm=sdpo", "arms.group_size=3"]))
    assert dataclasses.replace(base, arm="lopd") == base
