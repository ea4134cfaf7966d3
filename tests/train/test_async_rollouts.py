"""Asynchronous rollouts (``rollout.mode=async``) on the tiny config, in-process: k = 0
equals sync, k = 1 trains on batches one version old (stamped and counted), a resumed run
re-samples the lost steps with the restored student and counts them, GRPO runs async."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from configs import load_config
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.overrides import apply_overrides
from tests.train.test_arms_run import SHORT

TIMING = ("seconds", "per_minute", "rss_mb")  # wall-clock and host-memory fields differ between runs
ASYNC_ONLY = ("sampler_wait_seconds", "trainer_wait_seconds", "rollouts_resampled_on_resume", "partial_rollouts",
              "out_of_step_rollouts", "rollouts_restarted")
STEPS: dict = {}  # arm -> its jitted update, shared by this module's runs


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from train.bank_stage import build_bank
    from train.run_context import RunContext
    root = str(tmp_path_factory.mktemp("async"))
    cfg = apply_overrides(load_config("tiny"), SHORT + [f"workdir={root}/base", "stages.lopd_steps=3"])
    ctx = RunContext(cfg)
    frozen, lora0, comp0 = ctx.system.initial_params()
    bank, info = build_bank(ctx, {**frozen, **lora0}, root)
    return root, cfg, ctx, bank, info["path"], {"lora": lora0, "compressor": comp0}


def _run(shared, name, mode, k=1, arm="lopd", steps=3, eval_every=0, seen=None, partial=False, order="step"):
    """One training stage in ``<root>/<name>``; ``(final state, the stage's records)``.
    ``seen`` (a dict) collects the trajectories each step's batch was built from."""
    import train.training_stage as ts
    from lopd_jax.settings.arm_config import resolve_arm
    from train.metrics import MetricsWriter, read_metrics
    root, cfg, ctx, bank, bank_path, composer0 = shared
    wd = os.path.join(root, name)
    rollout = dataclasses.replace(cfg.rollout, mode=mode, max_staleness=k, partial=partial, batch_order=order)
    stages = dataclasses.replace(cfg.stages, lopd_steps=steps, eval_every=eval_every)
    ctx.cfg = resolve_arm(dataclasses.replace(cfg, arm=arm, workdir=wd, rollout=rollout, stages=stages))
    ctx.system.step_cfg = ctx.cfg.steps
    classes = (ts.ArmStage,)
    originals = {c: (c.__dict__["make_batch"], c.__dict__["make_step"]) for c in classes}
    for c, (batch_fn, step_fn) in originals.items():
        def make_batch(self, s, trajs, orig=batch_fn):
            if seen is not None:
                seen[s] = list(trajs)
            return orig(self, s, trajs)

        def make_step(self, state, batch, orig=step_fn):  # one compile per arm for the module's runs
            if arm not in STEPS:
                STEPS[arm] = orig(self, state, batch)
            return STEPS[arm]
        c.make_batch, c.make_step = make_batch, make_step
    writer = MetricsWriter(wd, console=False)
    try:
        state, preempted = ts.ArmStage(ctx, bank, bank_path, composer0, writer).run()
    finally:
        for c, (batch_fn, step_fn) in originals.items():
            c.make_batch, c.make_step = batch_fn, step_fn
        writer.close()
        ctx.cfg, ctx.system.step_cfg = cfg, cfg.steps
    assert not preempted
    return state, read_metrics(os.path.join(wd, "metrics.jsonl"), "lopd")


@pytest.fixture(scope="module")
def sync2(shared):
    """The sync stage of 2 steps every k = 0 comparison takes: ``(state, records, batches' trajectories)``."""
    seen: dict[int, list] = {}
    state, recs = _run(shared, "sync", "sync", steps=2, seen=seen)
    return state, recs, seen


def _comparable(rec):
    return {k: v for k, v in rec.items()
            if k not in ("time", "elapsed") + ASYNC_ONLY and not any(t in k for t in TIMING)}


def test_async_k0_equals_sync(shared, sync2):
    state_s, sync, _ = sync2
    state_a, k0 = _run(shared, "k0", "async", k=0, steps=2)
    assert len(sync) == len(k0) == 2
    for a, b in zip(sync, k0):
        assert _comparable(a) == _comparable(b)
        assert a["staleness_max"] == 0.0
        assert a["batch_host_seconds"] > 0 and a["train_seconds"] > 0  # the batch's host time beside the step's
    assert b["policy_version"] == 1.0 and b["composer_version"] == 1.0
    for x, y in zip(jax.tree.leaves(state_s["student"]), jax.tree.leaves(state_a["student"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_async_k1_is_one_version_behind_and_stamped(shared):
    seen: dict[int, list] = {}
    _, recs = _run(shared, "k1", "async", k=1, steps=3, eval_every=2, seen=seen)
    assert [r["staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert [r["staleness_mean"] for r in recs] == [0.0, 1.0, 1.0]
    assert [r["policy_version"] for r in recs] == [0.0, 1.0, 2.0]
    assert [{t.policy_version for t in seen[s]} for s in range(3)] == [{0}, {0}, {1}]
    for r in recs:
        assert r["rollouts"] == 8 and np.isfinite(r["loss"]) and r["rollouts_resampled_on_resume"] == 0
        assert r["sampler_wait_seconds"] >= 0 and r["trainer_wait_seconds"] >= 0 and r["batch_host_seconds"] > 0
    # step 1 samples the same student as step 0 but its own tasks and key: not step 0's rollouts
    assert [t.tokens.tolist() for t in seen[0]] != [t.tokens.tolist() for t in seen[1]]
    # the held-out evaluation after step 2 ran beside the rollout thread
    from train.metrics import read_metrics
    evals = read_metrics(os.path.join(shared[0], "k1", "metrics.jsonl"), "eval")
    assert [e["step"] for e in evals] == [2]


def test_async_builds_the_next_batch_while_the_step_runs(shared, monkeypatch):
    """Whole-step async rollouts: step s + 1's batch is built after step s's dispatch and
    before its metrics are read (its record follows); the last step builds nothing ahead."""
    import train.training_stage as ts
    events = []
    make_batch, record = ts.ArmStage.make_batch, ts.ArmStage.record
    monkeypatch.setattr(ts.ArmStage, "make_batch",
                        lambda self, s, trajs: events.append(("batch", s)) or make_batch(self, s, trajs))
    monkeypatch.setattr(ts.ArmStage, "record", lambda self, s, m: events.append(("record", s)) or record(self, s, m))
    _run(shared, "prefetch", "async", k=1, steps=3)
    assert events == [("batch", 0), ("batch", 1), ("record", 0), ("batch", 2), ("record", 1), ("record", 2)]


def test_async_resume_resamples_the_lost_steps_and_counts_them(shared):
    _, first = _run(shared, "resume", "async", k=1, steps=1)
    assert [r["step"] for r in first] == [1]
    _, recs = _run(shared, "resume", "async", k=1, steps=3)
    assert [r["step"] for r in recs] == [1, 2, 3]
    # step 1 would sample version 0 (lost): it samples the restored version 1 and says so
    assert [r["rollouts_resampled_on_resume"] for r in recs[1:]] == [8.0, 0.0]
    assert [r["staleness_max"] for r in recs[1:]] == [0.0, 1.0]


def test_grpo_arm_runs_async(shared):
    _, recs = _run(shared, "grpo", "async", k=1, arm="grpo", steps=2)
    assert [r["staleness_max"] for r in recs] == [0.0, 1.0]
    assert all(np.isfinite(r["loss"]) for r in recs)


def test_partial_k0_equals_sync(shared, sync2):
    """One engine run across the steps, gated to the newest student, is sync step for step."""
    state_s, sync, _ = sync2
    state_p, k0 = _run(shared, "partial_k0", "async", k=0, steps=2, partial=True)
    for a, b in zip(sync, k0):
        assert _comparable(a) == _comparable(b)
        assert b["partial_rollouts"] == 0
    for x, y in zip(jax.tree.leaves(state_s["student"]), jax.tree.leaves(state_p["student"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_partial_k1_swaps_weights_in_flight_within_the_bound_and_is_reproducible(shared):
    """k = 1: step s's tokens come from versions max(0, s - 1) .. s, episodes in flight at a
    swap are stamped with both ends, and the same seed gives the same run (environment steps
    on the engine's thread)."""
    runs = []
    for name in ("partial_k1", "partial_k1_again"):
        seen: dict[int, list] = {}
        state, recs = _run(shared, name, "async", k=1, steps=3, eval_every=2, seen=seen, partial=True)
        runs.append((state, recs, seen))
    state, recs, seen = runs[0]
    assert [r["staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    for s in range(3):
        for t in seen[s]:
            assert max(0, s - 1) <= t.policy_version <= t.latest_version <= s
    assert sum(r["partial_rollouts"] for r in recs) == sum(
        t.latest_version != t.policy_version for s in range(3) for t in seen[s])
    for r in recs:
        assert r["rollouts"] == 8 and np.isfinite(r["loss"])
    state2, recs2, seen2 = runs[1]
    for a, b in zip(recs, recs2):
        assert {k: v for k, v in a.items() if k not in ("time", "elapsed") and not any(t in k for t in TIMING)
                and "wait" not in k} == {k: v for k, v in b.items() if k not in ("time", "elapsed") and not any(
                    t in k for t in TIMING) and "wait" not in k}
    for s in range(3):
        assert [t.tokens.tolist() for t in seen[s]] == [t.tokens.tolist() for t in seen2[s]]
    for x, y in zip(jax.tree.leaves(state["student"]), jax.tree.leaves(state2["student"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    from train.metrics import read_metrics
    assert [e["step"] for e in read_metrics(os.path.join(shared[0], "partial_k1", "metrics.jsonl"), "eval")] == [2]


def _tasks(seen, steps):
    return sorted(t.task.task_id for s in steps for t in seen[s])


def test_finished_order_trains_every_drawn_task_once_within_the_bound_and_resumes_exactly(shared, sync2):
    """``rollout.batch_order=finished`` in a training stage: over the stage every drawn task
    trains exactly once, no batch is more than k versions old, and a run interrupted after
    step 1 and resumed (the checkpoint names the groups trained ahead) trains the same tasks
    once. (The tiny model's episodes all run to their
    caps, so they finish in admission order here; tests/train/test_partial_rollouts.py reorders.)"""
    sync_seen = sync2[2]
    seen: dict[int, list] = {}
    _, recs = _run(shared, "fin_k1", "async", k=1, steps=2, seen=seen, partial=True, order="finished")
    assert _tasks(seen, range(2)) == _tasks(sync_seen, range(2))
    assert all(r["staleness_max"] <= 1.0 and r["rollouts"] == 8 and np.isfinite(r["loss"]) for r in recs)
    for s in range(2):
        assert all(max(0, s - 1) <= t.policy_version <= t.latest_version <= s for t in seen[s])
    resumed: dict[int, list] = {}
    _run(shared, "fin_resume", "async", k=1, steps=1, seen=resumed, partial=True, order="finished")
    _, recs3 = _run(shared, "fin_resume", "async", k=1, steps=2, seen=resumed, partial=True, order="finished")
    assert [r["step"] for r in recs3] == [1, 2]
    assert _tasks(resumed, range(2)) == _tasks(sync_seen, range(2))
    assert all(r["staleness_max"] <= 1.0 for r in recs3)


def test_finished_order_at_k0_equals_sync(shared, sync2):
    state_s, sync, _ = sync2
    state_f, k0 = _run(shared, "fin0", "async", k=0, steps=2, partial=True, order="finished")
    for a, b in zip(sync, k0):
        assert _comparable(a) == _comparable(b)
    for x, y in zip(jax.tree.leaves(state_s["student"]), jax.tree.leaves(state_f["student"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rollout_mode_settings_are_checked():
    with pytest.raises(ConfigError, match="rollout.partial=true"):
        apply_overrides(load_config("tiny"), ["rollout.mode=async", "rollout.batch_order=finished"])
    with pytest.raises(ConfigError, match="rollout.mode=async"):
        apply_overrides(load_config("tiny"), ["rollout.partial=true"])
    with pytest.raises(ConfigError, match="max_staleness"):
        apply_overrides(load_config("tiny"), ["rollout.mode=async", "rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.mode"):
        apply_overrides(load_config("tiny"), ["rollout.mode=overlap"])
    cfg = apply_overrides(load_config("tiny"), ["rollout.mode=async", "rollout.max_staleness=2"])
    assert (cfg.rollout.mode, cfg.rollout.max_staleness) == ("async", 2)
    assert load_config("tiny").rollout.mode == "sync"


def test_sampling_versions_and_staleness():
    from train.async_rollouts import sampling_version, staleness_metrics
    assert [sampling_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]
    assert [sampling_version(s, 2, start=3) for s in range(3, 7)] == [3, 3, 3, 4]
    m = staleness_metrics([3, 3, 2, 1], 3)
    assert m["staleness_max"] == 2 and m["staleness_mean"] == 0.75 and m["policy_version"] == 3
