"""The engine's scheduler (lopd_jax/rollout/scheduler.py) driven by a fake device call:
plain numpy tokens that depend only on the episode and the position (as the engine's keys
make the real ones), so every schedule must give the same trajectories. Admission order,
preemption and resume, page growth and release, environment timeouts, a feed's drops,
cancel and weight versions; and the module imports no JAX."""

import dataclasses
import subprocess
import sys
import threading

import numpy as np
import pytest

from lopd_jax.rollout.env_threads import EnvThreads
from lopd_jax.rollout.episode_spec import EpisodeSpec, FeedItem
from lopd_jax.rollout.scheduler import Scheduler, row_count
from lopd_jax.settings.sections import EngineConfig
from tests.paths import ROOT
from tests.rollout.feeds import ScriptedFeed

V, STOPS = 50, (7, 19, 33)


def token(eid: int, pos: int, params) -> int:
    """The fake model's token at context position ``pos`` of episode ``eid`` (``params``
    shift it: new weights sample other tokens)."""
    return (eid * 31 + pos * 17 + 3 * (params or 0)) % V


class FakeDevice:
    """The engine's two device calls on numpy rows: a prefill samples each row's token after
    its piece, a decode chunk samples up to ``K`` tokens per live row and stops a row at a
    stop id or its remaining budget, as :mod:`lopd_jax.rollout.engine_calls` does."""

    def __init__(self, K: int):
        self.K, self.calls = K, []

    def prefill(self, rows, params):
        self.calls.append(("prefill", len(rows.ids)))
        tok = np.asarray([token(int(e), int(s + n), params) for e, s, n in zip(rows.eids, rows.start, rows.n)],
                         np.int32)
        return tok, -(tok % 5).astype(np.float32), -(tok % 3).astype(np.float32)

    def decode(self, rows, params):
        self.calls.append(("decode", len(rows.prev)))
        B = len(rows.prev)
        toks, n_gen = np.zeros((B, self.K), np.int32), np.zeros(B, np.int32)
        for r in np.flatnonzero(rows.live):
            for j in range(self.K):
                toks[r, j] = token(int(rows.eids[r]), int(rows.lengths[r]) + j + 1, params)
                n_gen[r] += 1
                if toks[r, j] in STOPS or n_gen[r] >= rows.remaining[r]:
                    break
        return toks, -(toks % 5).astype(np.float32), -(toks % 3).astype(np.float32), n_gen


def prefill(sched: Scheduler, device: FakeDevice, batch) -> None:
    """Prefill an admitted ``batch`` piece by piece; its first tokens start their turns."""
    pf = sched.prefill(batch)
    while (rows := pf.next_piece()) is not None:
        pf.take(*device.prefill(rows, sched.params))
    sched.start_turns(pf)


def drive(sched: Scheduler, device: FakeDevice) -> dict:
    """The engine's loop (:meth:`lopd_jax.rollout.engine.Engine.run`) on ``device``."""
    while sched.poll():
        batch = sched.admit()
        if batch:
            prefill(sched, device, batch)
        plan = sched.plan_decode()
        if plan is not None:
            sched.take_decode(plan, *device.decode(plan.inputs, sched.params))
        elif not batch:
            sched.unblock()
    return sched.finish()


def scripted(turns: int, obs=(11, 12)):
    """A step function: the observation ``obs`` after each turn, over after ``turns``."""
    state = {"t": 0}

    def step(ids, lps, raws):
        state["t"] += 1
        return None if state["t"] >= turns else list(obs)
    return step


def specs(n: int = 7, max_total: int = 40):
    rs = np.random.RandomState(0)
    return [EpisodeSpec(rs.randint(1, V, size=rs.randint(2, 12)).tolist(), max_total, 4 + i % 5, scripted(1 + i % 3))
            for i in range(n)]


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"slots": 2, "page_size": 8, "decode_chunk": 3, "prefill_chunk": 4, "env_workers": 0,
                           **kw})


def run(cfg: EngineConfig, episodes, num_pages: int, **kw):
    sched = Scheduler(cfg, episodes, num_pages=num_pages, max_total=40, stop_ids=STOPS, **kw)
    return sched, drive(sched, FakeDevice(cfg.decode_chunk))


def expected(spec: EpisodeSpec, eid: int) -> list[list[int]]:
    """Episode ``eid``'s turns, computed from the fake model alone."""
    ctx, turns, step = list(spec.first), [], spec.step
    while True:
        cap = min(spec.max_turn, spec.max_total - len(ctx))
        turn = []
        while True:
            turn.append(token(eid, len(ctx) + len(turn), None))
            if turn[-1] in STOPS or len(turn) >= cap:
                break
        turns.append(turn)
        ctx += turn
        obs = step(np.asarray(turn), None, None)
        if obs is None or len(ctx) + len(obs) >= spec.max_total:
            return turns
        ctx += obs


def turns_of(sched: Scheduler):
    return [[t.tolist() for t in ep.result.turns] for ep in sched.eps]


def test_admission_takes_ready_episodes_in_queue_order_and_refills_slots():
    sched, device = Scheduler(config(slots=3), specs(5), num_pages=64, max_total=40, stop_ids=STOPS), FakeDevice(3)
    assert sched.poll()
    batch = sched.admit()
    assert [ep.eid for ep in batch] == [0, 1, 2] and sched.admit() == []
    assert [ep.eid for ep in sched.slots] == [0, 1, 2] and [ep.eid for ep in sched.ready] == [3, 4]
    prefill(sched, device, batch)
    m = drive(sched, device)
    assert turns_of(sched) == [expected(s, i) for i, s in enumerate(specs(5))]
    assert [ep.admitted > 0 for ep in sched.eps] == [True] * 5 and m["leaked_pages"] == 0
    assert m["prefill_calls"] >= 3 and m["decode_calls"] > 0


def test_every_schedule_samples_the_episodes_own_tokens():
    """Two slots on a pool that forces waits and preemptions == five slots on an ample
    pool == the fake model's tokens computed episode by episode."""
    tight, m = run(config(), specs(), num_pages=7)
    ample, m2 = run(config(slots=5, decode_chunk=2), specs(), num_pages=64)
    assert m["preemptions"] > 0 and m["recomputed_tokens"] > 0 and m["admission_waits"] > 0
    assert m2.get("preemptions", 0) == 0 and m["peak_pages"] <= 7 and m["leaked_pages"] == m2["leaked_pages"] == 0
    assert turns_of(tight) == turns_of(ample) == [expected(s, i) for i, s in enumerate(specs())]
    assert all(ep.result.error is None and ep.result.context for ep in tight.eps)
    ends = [t[-1] for ep in tight.eps for t in turns_of(tight)[ep.eid]]
    assert any(e in STOPS for e in ends) and not all(e in STOPS for e in ends)  # stop ids and caps both end turns


def test_a_preempted_episode_goes_first_and_is_recomputed_from_its_context():
    same = lambda: [EpisodeSpec([1, 2, 3], 40, 10, scripted(2)) for _ in range(4)]  # noqa: E731
    sched = Scheduler(config(), same(), num_pages=64, max_total=40, stop_ids=STOPS)
    device = FakeDevice(3)
    sched.poll()
    prefill(sched, device, sched.admit())
    plan = sched.plan_decode()
    sched.take_decode(plan, *device.decode(plan.inputs, None))
    victim = next(ep for ep in sched.slots if ep is not None)
    cached, free = victim.cached + len(victim.turn), len(sched.pages.free)
    sched.preempt(victim)
    assert sched.ready[0] is victim and victim.slot is None and victim.pages == [] and victim.turn == []
    assert len(sched.pages.free) > free and sched.m["recomputed_tokens"] == cached and sched.m["preemptions"] == 1
    sched.poll()
    batch = sched.admit()
    assert batch[0] is victim  # back at the head of the queue
    prefill(sched, device, batch)
    drive(sched, device)
    assert turns_of(sched) == [expected(s, i) for i, s in enumerate(same())]


def test_pages_grow_with_each_chunk_and_go_back_when_an_episode_ends():
    cfg = config(slots=1, page_size=4, decode_chunk=2)
    spec = EpisodeSpec(list(range(1, 9)), 30, 12, scripted(1))  # 12 tokens without a stop id
    sched = Scheduler(cfg, [spec], num_pages=8, max_total=30, stop_ids=STOPS)
    device = FakeDevice(2)
    sched.poll()
    (ep,) = sched.admit()
    assert len(ep.pages) == 3  # 8 ids + the first chunk's 2 tokens -> 10 cached ids -> 3 pages of 4
    prefill(sched, device, [ep])
    seen = []
    while ep.slot is not None:
        plan = sched.plan_decode()
        seen.append(len(ep.pages))
        assert len(ep.pages) == -(-(ep.cached + min(2, ep.cap - len(ep.turn))) // 4)
        table = plan.inputs.page_table
        assert table.shape[0] == row_count(1, 1) and table[0, :len(ep.pages)].tolist() == ep.pages
        sched.take_decode(plan, *device.decode(plan.inputs, None))
    assert seen == sorted(seen) and seen[-1] > seen[0]
    assert ep.pages and len(sched.pages.free) == 8 - len(ep.pages)  # kept while its environment steps
    m = drive(sched, device)
    assert ep.pages == [] and sorted(sched.pages.free) == list(range(8)) and m["leaked_pages"] == 0


def test_a_step_past_the_timeout_ends_its_episode_only():
    release, abandoned = threading.Event(), []

    def hang(ids, lps, raws):
        release.wait(30)
        return [11]

    eps = specs(4)
    eps[1] = dataclasses.replace(eps[1], step=hang, abandon=lambda: abandoned.append(1))
    pool = EnvThreads(2)
    try:
        sched, m = run(config(env_workers=2, env_timeout_s=0.2), eps, num_pages=64, pool=pool)
    finally:
        release.set()
        pool.close()
    assert sched.eps[1].result.error.startswith("timeout") and len(sched.eps[1].result.turns) == 1
    assert m["env_timeouts"] == 1 and m["env_errors"] == 1 and abandoned == [1] and pool.abandoned == 1
    ok = [i for i in range(4) if i != 1]
    assert all(sched.eps[i].result.error is None for i in ok) and m["leaked_pages"] == 0
    assert [turns_of(sched)[i] for i in ok] == [expected(specs(4)[i], i) for i in ok]


def Feed(groups, drop=(), cancel_after=None):
    """Groups of episodes, the second with new weights (``params`` 1, version 1); drops
    ``drop`` when the first episode ends; ``cancel_after`` episodes end the run."""
    return ScriptedFeed(groups, swaps={1: (1, 1)}, cancel_after=cancel_after, drop_on_first_end=drop, max_total=40)


def keyed(n=7):
    return [dataclasses.replace(s, identity=i) for i, s in enumerate(specs(n))]


def test_a_feed_swaps_weights_in_flight_and_every_token_records_its_version():
    eps = keyed()
    feed = Feed([eps[:4], eps[4:]])
    swapped = []
    sched, m = run(config(), [], num_pages=64, feed=feed, local_params=lambda p: swapped.append(p) or p)
    assert swapped == [1] and sched.params == 1 and sched.version == 1 and m["weight_swaps"] == 1
    assert sorted(feed.results) == list(range(7)) and m["leaked_pages"] == 0
    for i, r in feed.results.items():
        assert all(len(v) == len(t) for v, t in zip(r.versions, r.turns))
        lo, hi = r.version_range()
        assert (lo, hi) == (1, 1) if i >= 4 else lo == 0
        pos = len(eps[i].first)
        for t, v in zip(r.turns, r.versions):  # each token sampled by its version's weights
            assert t.tolist() == [token(i, pos + j, int(v[j]) or None) for j in range(len(t))]
            pos += len(t) + 2  # the turn and its observation
    assert any(r.version_range() == (0, 1) for i, r in feed.results.items() if i < 4)  # went on under new weights


def test_a_feed_drops_episodes_wherever_they_are_and_cancels_the_run():
    eps = keyed()
    feed = Feed([eps], drop=eps[3:5])
    sched, m = run(config(), [], num_pages=64, feed=feed)
    dropped = {3, 4} - set(feed.results)
    assert dropped and m["dropped_episodes"] == len(dropped) and m["leaked_pages"] == 0
    assert set(feed.results) == set(range(7)) - dropped
    feed = Feed([keyed()], cancel_after=1)
    sched, m = run(config(), [], num_pages=64, feed=feed)
    assert len(feed.results) == 1 and m["cancelled_episodes"] == 6 and m["leaked_pages"] == 0


def test_a_feed_that_leaves_an_idle_engine_nothing_is_an_error():
    class Empty(ScriptedFeed):
        def more(self, idle):
            return FeedItem()
    with pytest.raises(RuntimeError, match="must block"):
        run(config(), [], num_pages=64, feed=Empty([]))


def test_the_scheduler_imports_no_jax():
    code = "import sys, lopd_jax.rollout.scheduler; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_one_thread_pool_serves_every_run_and_abandoned_threads_exit():
    """Runs that time out steps on one pool leave it as wide as it was: each abandoned
    thread exits once its step returns, its replacement stays; close() ends them all."""
    def slow(ids, lps, raws):
        threading.Event().wait(0.5)
        return None

    before = threading.active_count()
    pool = EnvThreads(2)
    for _ in range(3):
        eps = specs(3)
        eps[0] = dataclasses.replace(eps[0], step=slow)
        sched, m = run(config(env_workers=2, env_timeout_s=0.1), eps, num_pages=64, pool=pool)
        assert m["env_timeouts"] == 1 and sched.eps[0].result.error.startswith("timeout")
    deadline = threading.Event()
    for _ in range(50):  # the slow steps return within 0.5 s; their threads then exit
        if threading.active_count() == before + 2:
            break
        deadline.wait(0.05)
    assert threading.active_count() == before + 2 and pool.abandoned == 3 and pool.started == 5
    pool.close()
    for _ in range(50):
        if threading.active_count() == before:
            break
        deadline.wait(0.05)
    assert threading.active_count() == before
