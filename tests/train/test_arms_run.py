"""Every arm's training stage runs on the tiny config: one shared run context (model,
sampler, bank) and one step per arm, in-process (the sampler compiles once). The LOPD,
GRPO and a text arm's stage with ``lengths.packing=true`` write the same step as padded."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from lopd_jax.settings.arm_config import ARMS
from configs import load_config
from lopd_jax.settings.overrides import apply_overrides
from tests.train.records import volatile

SHORT = ["stages.warmup_steps=0", "stages.cold_start_steps=1", "stages.lopd_steps=1", "stages.eval_tasks=1",
         "stages.eval_every=0", "env.tasks_per_step=8", "env.kwargs.n_train_per_family=1",
         "env.kwargs.n_heldout_per_family=1", "bank.min_reward=0.0", "checkpoint.every_steps=1",
         "checkpoint.async_save=false", "composer.max_experience_tokens=32", "rollout.max_env_steps=1",
         "rollout.max_turn_tokens=16", "rollout.max_total_tokens=384", "arms.context_tokens=96"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from train.bank_stage import build_bank
    from train.run_context import RunContext
    root = str(tmp_path_factory.mktemp("arms"))
    cfg = apply_overrides(load_config("tiny"), SHORT + [f"workdir={root}/base"])
    ctx = RunContext(cfg)
    frozen, lora0, comp0 = ctx.system.initial_params()
    bank, info = build_bank(ctx, {**frozen, **lora0}, root)
    return root, cfg, ctx, bank, info["path"], {"lora": lora0, "compressor": comp0}


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


_RUNS: dict = {}  # (arm, packing) -> (state, record): the padded runs are shared with the packed comparison


def _train(shared, arm: str, packing: bool = False):
    """``arm``'s training stage (one step) on the shared context; ``(state, metrics record)``."""
    from lopd_jax.settings.arm_config import resolve_arm
    from train.training_stage import ArmStage
    from train.metrics import MetricsWriter, read_metrics
    if (arm, packing) in _RUNS:
        return _RUNS[arm, packing]
    root, cfg, ctx, bank, bank_path, composer0 = shared
    wd = os.path.join(root, arm + ("_packed" if packing else ""))
    run_cfg = dataclasses.replace(cfg, arm=arm, workdir=wd,
                                  lengths=dataclasses.replace(cfg.lengths, packing=packing))
    ctx.cfg = resolve_arm(run_cfg)
    ctx.system.step_cfg = ctx.cfg.steps  # the frozen arm's steps.freeze_composer
    writer = MetricsWriter(wd, console=False)
    try:
        state, preempted = ArmStage(ctx, bank, bank_path, composer0, writer).run()
    finally:
        writer.close()
        ctx.system.step_cfg = cfg.steps
        ctx.cfg = cfg
    assert not preempted and int(state["step"]) == 1
    (rec,) = read_metrics(os.path.join(wd, "metrics.jsonl"), "lopd")
    _RUNS[arm, packing] = jax.device_get(state), rec
    return _RUNS[arm, packing]


@pytest.mark.parametrize("arm", ARMS)
def test_arm_training_stage_runs(shared, arm):
    ctx, composer0 = shared[2], shared[5]
    state, rec = _train(shared, arm)
    assert rec["rollouts"] == 8 and np.isfinite(rec["loss"])
    theta0 = _leaves(ctx.system.initial_params()[0])
    moved = any(not np.array_equal(a, b) for a, b in zip(_leaves(state["student"]), theta0))
    same_composer = all(np.array_equal(a, b) for a, b in zip(_leaves(state["composer"]), _leaves(composer0)))
    if arm == "grpo":  # old_logp = the sampler's raw log-probs: the first update's ratio is 1
        assert abs(rec["ratio_mean"] - 1.0) < 1e-3 and rec["ratio_max_dev"] < 1e-2
    if arm == "lopd":
        assert not same_composer and "delta" in rec and "beta" in rec
    else:
        assert same_composer  # frozen composer, or no composer at all
    if arm in ("opsd", "sdft", "skill_sd", "experiences_text"):  # every row has a context
        assert rec["supervised_rollouts"] > 0 and moved and rec["distill_kl"] >= 0
    if arm == "sdft":
        assert any(not np.array_equal(a, b) for a, b in zip(_leaves(state["ema"]), theta0))
    if arm == "grpo" and rec["student_grad_norm"] == 0:
        assert rec["loss"] == 0  # every group had one reward: zero advantages


def test_bank_passes_offer_each_task_again_and_keep_the_first_pass(shared, tmp_path):
    """``bank.passes=2``: every training task is rolled out twice; the first pass is the
    one-pass bank exactly (same keys), the second samples with new keys."""
    import copy

    from train.bank_stage import build_bank
    root, cfg, ctx, bank, _, composer0 = shared
    two = copy.copy(ctx)
    two.cfg = dataclasses.replace(cfg, bank=dataclasses.replace(cfg.bank, passes=2))
    frozen, lora0, _ = ctx.system.initial_params()
    bank2, info = build_bank(two, {**frozen, **lora0}, str(tmp_path))
    n = len(ctx.train_tasks)
    assert info["rollouts"] == 2 * n and info["passes"] == 2 and len(bank) == n  # min_reward 0: all admitted
    assert len(bank2) == 2 * n
    ids = [e.token_ids for e in bank2.entries]
    assert ids[:n] == [e.token_ids for e in bank.entries]
    assert [e.task_id for e in bank2.entries[n:]] == [e.task_id for e in bank.entries]
    assert ids[n:] != ids[:n]


@pytest.mark.parametrize("arm", ["lopd", "grpo", "opsd"])
def test_packed_training_stage_equals_padded(shared, arm):
    """``lengths.packing=true`` through the stage (``RunContext.bucketed`` -> packed passes,
    latent blocks per segment for LOPD, context blocks for OPSD, group advantages before
    packing for GRPO): the same rollouts, the same step metrics and the same updated
    student and composer as the padded stage, within fp32 summation order."""
    from train.metrics import SHARE_KEYS
    padded_state, padded = _train(shared, arm)
    packed_state, packed = _train(shared, arm, packing=True)
    assert set(packed) == set(padded), set(padded) ^ set(packed)
    for k, v in packed.items():
        if volatile(k):
            continue
        if k in SHARE_KEYS:  # ratios of gradient norms, the distillation term's a remainder
            assert v == pytest.approx(padded[k], abs=1e-3), (k, v, padded[k])
        elif isinstance(v, float):
            # near-zero KL-type values (student == theta0) keep only fp32-rounding digits
            assert v == pytest.approx(padded[k], rel=1e-3, abs=1e-6), (k, v, padded[k])
        else:
            assert v == padded[k], k
    for name in ("student", "composer"):
        for a, b in zip(_leaves(packed_state[name]), _leaves(padded_state[name])):
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-3, atol=1e-6,
                                       err_msg=name)
