"""The RL-step schedule model (lopd_jax.planning.rl_schedule) and ``compile_sampler --rl_step``."""

import itertools
import re
import subprocess
import sys

import pytest

from lopd_jax.planning.engine_schedule import draw_episodes, simulate_engine
from lopd_jax.planning.rl_schedule import RLSchedule, RLStepTimes, simulate_rl, steps_per_hour
from lopd_jax.settings.length_config import LengthConfig

LC = LengthConfig(prompt_median=200, turns_mean=4, turn_median=60, obs_median=80)
CAPS = dict(max_turns=8, max_turn_tokens=256, max_total_tokens=4096)


def stream(seed=0):
    for i in itertools.count():
        yield from draw_episodes(LC, 64, **CAPS, seed=seed * 1000 + i)


# time in decode steps: one decode step = 1 s, no KV term, environments take 7 steps per turn
STEPS = RLStepTimes(decode_weights_s=1.0, decode_kv_s_per_token=0.0, train_s=0.0, sync_s=0.0, env_s=7.0)


def test_sync_step_is_the_engine_schedule_of_its_batch():
    """With training free, a sync step lasts what the engine schedule gives one batch of
    episodes admitted at once (simulate_engine, counted in decode steps)."""
    sched = RLSchedule(mode="sync", batch=6, slots=8, chunk=4)
    r = simulate_rl(stream(), sched, STEPS, steps=1)
    eps = list(itertools.islice(stream(), 6))
    assert r["wall_s"] == simulate_engine(eps, slots=8, in_flight=6, chunk=4, env_steps=7)["steps"]
    assert r["staleness_max"] == 0 and r["dropped_per_step"] == 0


def test_async_at_k0_is_sync_and_async_keeps_more_rows_busy():
    times = RLStepTimes(1.0, 0.0, train_s=300.0, sync_s=5.0, env_s=7.0)
    base = dict(batch=4, slots=16, chunk=4)
    sync = simulate_rl(stream(), RLSchedule(mode="sync", **base), times, steps=6)
    k0 = simulate_rl(stream(), RLSchedule(mode="async", max_staleness=0, **base), times, steps=6)
    assert k0 == sync
    k2 = simulate_rl(stream(), RLSchedule(mode="async", max_staleness=2, **base), times, steps=6)
    assert k2["busy_rows"] > sync["busy_rows"]
    assert steps_per_hour(k2) > steps_per_hour(sync)


@pytest.mark.parametrize("placement", ["colocated", "split"])
@pytest.mark.parametrize("k", [1, 2])
def test_drop_bounds_staleness_and_keep_drops_nothing(placement, k):
    times = RLStepTimes(1.0, 0.0, train_s=120.0, sync_s=1.0, env_s=7.0)
    base = dict(mode="async", placement=placement, max_staleness=k, batch=4, slots=16, chunk=4)
    drop = simulate_rl(stream(1), RLSchedule(stale="drop", **base), times, steps=8)
    assert drop["staleness_max"] <= k
    keep = simulate_rl(stream(1), RLSchedule(stale="keep", **base), times, steps=8)
    assert keep["dropped_per_step"] == 0 and keep["dropped_tokens_per_step"] == 0
    assert simulate_rl(stream(1), RLSchedule(stale="drop", **base), times, steps=8) == drop  # deterministic


@pytest.mark.parametrize("k", [1, 2])
def test_step_batches_stay_within_the_bound_without_drops(k):
    """``batches=step`` (rollout.partial as built): step s trains on its own groups, so no
    episode is ever more than k versions old and none is dropped; at k = 0 it is sync, and
    it keeps fewer rows busy than training on the first finished groups."""
    times = RLStepTimes(1.0, 0.0, train_s=120.0, sync_s=1.0, env_s=7.0)
    base = dict(mode="async", max_staleness=k, batch=4, slots=16, chunk=4)
    step = simulate_rl(stream(1), RLSchedule(batches="step", **base), times, steps=8)
    assert step["staleness_max"] <= k and step["dropped_per_step"] == 0
    sync = simulate_rl(stream(1), RLSchedule(mode="sync", batch=4, slots=16, chunk=4), times, steps=8)
    assert steps_per_hour(step) > steps_per_hour(sync)
    assert simulate_rl(stream(1), RLSchedule(mode="sync", batches="step", batch=4, slots=16, chunk=4), times,
                       steps=8) == sync


def test_host_time_not_overlapped_lengthens_the_step_and_idles_the_chips():
    """``host_step_s`` adds itself to every sync step (the batch decodes after the step);
    ``host_chunk_s`` to every decode chunk; the chips count neither as busy."""
    base = dict(decode_weights_s=1.0, decode_kv_s_per_token=0.0, train_s=300.0, sync_s=5.0, env_s=7.0)
    sched = RLSchedule(mode="sync", batch=4, slots=16, chunk=4)
    plain = simulate_rl(stream(), sched, RLStepTimes(**base), steps=6)
    step = simulate_rl(stream(), sched, RLStepTimes(**base, host_step_s=10.0), steps=6)
    assert step["seconds_per_step"] == pytest.approx(plain["seconds_per_step"] + 10.0)
    assert step["chips_idle"] > plain["chips_idle"]
    chunk = simulate_rl(stream(), sched, RLStepTimes(**base, host_chunk_s=0.5), steps=6)
    assert chunk["seconds_per_step"] > plain["seconds_per_step"] and chunk["chips_idle"] > plain["chips_idle"]


def test_groups_are_trained_whole():
    """A batch is whole groups: with groups of 4 and a batch of 8, every step trains 8."""
    times = RLStepTimes(1.0, 0.0, train_s=50.0, sync_s=0.0, env_s=3.0)
    r = simulate_rl(stream(2), RLSchedule(mode="async", batch=8, group_size=4, slots=16, chunk=4), times, steps=5)
    assert r["steps"] == 5 and r["seconds_per_step"] > 50.0


@pytest.mark.parametrize("kw", [dict(mode="later"), dict(placement="split", sampler_share=1.0),
                                dict(batch=6, group_size=4), dict(max_staleness=-1), dict(stale="maybe"),
                                dict(batches="any")])
def test_bad_schedules_are_refused(kw):
    with pytest.raises(ValueError):
        RLSchedule(**kw)


@pytest.mark.process
def test_compile_sampler_rl_step_prints_the_comparison():
    """``--rl_step`` on a TPU topology (AOT, no chips): the table and its verdict line."""
    pytest.importorskip("libtpu")
    out = subprocess.run([sys.executable, "-m", "lopd_jax.compile_sampler", "--config=qwen3_8b", "--topology=v5p-8",
                          "--rl_step", "--rl_steps=6", "--rl_seeds=1"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"rl step model: async/sync steps per hour = \d+\.\d\dx \(k = [12], placement \S+( \S+)?\)",
                        lines[-1]), lines[-1]
    assert sum(line.strip().startswith(("colocated", "partial", "split")) for line in lines) == 18
    bad = subprocess.run([sys.executable, "-m", "lopd_jax.compile_sampler", "--config=qwen3_8b", "--rl_step",
                          "--mfu=2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--mfu" in bad.stderr
    assert re.search(r"host not overlapped \d+\.\d\d ms per chunk, \d+\.\d\d s per step", out.stdout)
