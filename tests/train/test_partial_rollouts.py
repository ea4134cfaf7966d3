"""Finished-order batches of partial rollouts (train/partial_rollouts.py) against a scripted
engine that ends episodes in a seeded random order: every drawn group trains exactly once
(also across a resume from the checkpoint's resume point), groups trained out of their draw
step happen, no batch is more than k versions old, and GRPO groups stay whole."""

import threading
import types

import numpy as np
import pytest

from lopd_jax.rollout.episode_spec import EpisodeResult
from lopd_jax.rollout.episodes import EpisodeBatch, EpisodeSpec, _Episode
from train.partial_rollouts import PartialRolloutPipeline, split_groups

TASKS, GROUP = 4, 2  # tasks per draw step, rows per group: 8 rows, 4 groups per step


def _prepare(d, tasks, first):
    episodes = [_Episode(t, None) for t in tasks]
    specs = [EpisodeSpec([1], 8, 4, None, identity=first + i) for i in range(len(episodes))]
    return EpisodeBatch(episodes, list(range(len(episodes))), specs)


def _scripted_engine(seed, room=10):
    """An engine stand-in: takes work from the feed while fewer than ``room`` episodes run,
    ends one episode at a time in a seeded random order, each stamped with the version of
    the weights when it was given."""
    def run(params, feed, version=0):
        rs, running, over = np.random.RandomState(seed), [], False
        while not feed.cancelled:
            dropped = {id(x) for x in feed.take_drops()}
            running = [(spec, v) for spec, v in running if id(spec) not in dropped]
            if not over and len(running) < room:
                item = feed.more(not running)
                if item is None:
                    over = True
                else:
                    version = item.version if item.params is not None else version
                    running += [(spec, version) for spec in item.episodes]
            if not running:
                if over:
                    return
                continue
            spec, v = running.pop(rs.randint(len(running)))
            feed.ended(spec, EpisodeResult([np.asarray([3])], [np.zeros(1)], [np.zeros(1)], [1, 3],
                                           versions=[np.asarray([v])]))
    return run


def _pipeline(start, steps, k, first_draw=None, skip=(), seed=0, stale="wait"):
    state = {"d": start if first_draw is None else first_draw}

    def draw(d):
        assert d == state["d"]
        state["d"] += 1
        return [types.SimpleNamespace(task_id=f"{d}/{i}") for i in range(TASKS) for _ in range(GROUP)]
    run = _scripted_engine(seed)
    return PartialRolloutPipeline(lambda n: (0, n), _prepare, lambda p, feed: run(p, feed, start), 8, 0.0, draw,
                                  lambda: dict(state), start, steps, k, "params0", order="finished",
                                  group_size=GROUP, first_draw=first_draw, skip=skip, stale=stale)


def _train(pipe, start, stop, k, out):
    """The trainer's side: take batches start..stop-1, publish each version a later draw
    needs; the rollouts restarted."""
    restarted = 0
    for s in range(start, stop):
        trajs, info = pipe.get(s)
        out[s] = trajs
        restarted += info["rollouts_restarted"]
        assert len(trajs) == TASKS * GROUP
        assert all(s - k <= t.policy_version <= s for t in trajs), (s, [t.policy_version for t in trajs])
        for g in range(0, len(trajs), GROUP):  # whole groups, each from one task
            assert len({t.task.task_id for t in trajs[g:g + GROUP]}) == 1
        if pipe.wants(s + 1):
            pipe.publish(s + 1, f"params{s + 1}")
    return restarted


@pytest.mark.parametrize("stale", ["wait", "restart"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_every_drawn_group_trains_once_within_the_bound_across_a_resume(k, seed, stale):
    steps, cut = 7, 3
    whole: dict[int, list] = {}
    pipe = _pipeline(0, steps, k, seed=seed, stale=stale)
    restarted = _train(pipe, 0, steps, k, whole)
    pipe.close()
    assert (restarted > 0) == (stale == "restart" and k > 0)  # these streams always leave a straggler
    ids = lambda batches: sorted(t.task.task_id for b in batches.values() for t in b)
    assert ids(whole) == sorted(f"{d}/{i}" for d in range(steps) for i in range(TASKS) for _ in range(GROUP))
    lag = any(t.task.task_id.split("/")[0] != str(s) for s, b in whole.items() for t in b)
    assert lag == (k > 0)  # trained out of draw order, except at k = 0 (sync)

    first: dict[int, list] = {}
    pipe = _pipeline(0, steps, k, seed=seed, stale=stale)
    _train(pipe, 0, cut, k, first)
    d0, trained = pipe.resume_point(cut)
    pipe.close()
    assert d0 <= cut and all(d >= d0 for d, _ in trained)
    rest: dict[int, list] = {}
    pipe = _pipeline(cut, steps, k, first_draw=d0, skip=trained, seed=seed + 10, stale=stale)
    _train(pipe, cut, steps, k, rest)
    pipe.close()
    assert ids({**first, **rest}) == ids(whole)  # every group exactly once, none lost to the interruption


def test_rows_that_are_not_whole_groups_are_refused():
    batch = _prepare(0, [types.SimpleNamespace(task_id="t")] * 6, 0)
    assert len(split_groups(batch, 2)) == 3
    with pytest.raises(ValueError, match="whole groups"):
        split_groups(batch, 4)
