"""Partial rollouts (``rollout.partial=true`` with ``rollout.mode=async``): one engine run
across the steps of a training stage, its slots kept full from step to step.

:class:`PartialRolloutPipeline` has :class:`train.async_rollouts.RolloutPipeline`'s
trainer side (``publish`` / ``get`` / ``close``) but runs a single
:meth:`lopd_jax.rollout.engine.Engine.run` on its thread, fed by :class:`StepFeed`. The
tasks are drawn step by step ("draw step" d, with d's key); draw step d's episodes are
admitted, a GRPO group (``env.group_size`` rows) at a time, as soon as the engine has room
and the student of version ``v(d) = max(start, d - k)`` is published. Admitting them swaps
the weights of every episode in flight to ``v(d)`` (their caches, computed under older
weights, are kept). Each token records the version that sampled it; a trajectory's
``policy_version`` is its oldest token's, ``latest_version`` its newest.

Which groups train at step s (``rollout.batch_order``):

- ``step``: draw step s's groups, once all have finished (tasks stay tied to steps; the
  trainer still waits for step s's slowest episode). Staleness <= k.
- ``finished``: this process's quota of groups (its rows of a step) in the order they
  finish, except that a group admitted under version a must train by step a + k. Step s
  first takes, earliest-due first, as many finished groups as leave at most (t - s) quotas
  due by each later step t (waiting for them if they are still running), then fills its
  quota with the first groups to finish. The admission gate (draw step d under version
  >= d - k) keeps at most k + 1 quotas untrained, so every deadline can be met and
  staleness <= k. A checkpoint records where the
  task iterator must restart (the oldest draw step with a group not yet trained, on any
  process) and the groups after it already trained, per process; a resumed run skips
  those, so every drawn group trains exactly once.

The feed waits for ``v(d)`` only once every batch below ``v(d)`` is delivered (the trainer
then has what it needs to make it): with environment steps on the engine's thread
(``engine.env_workers=0``, latency counted in engine steps) a run is a function of the seed
and the process layout. docs/rl_step.md, "Partial rollouts".
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from lopd_jax.rollout.episode_spec import EpisodeResult, EpisodeSpec, FeedItem
from lopd_jax.rollout.episodes import EpisodeBatch, finish_episodes
from train.async_rollouts import RolloutPipeline, sampling_version


@dataclasses.dataclass
class _Group:
    """One GRPO group of this process's rows of a draw step, from admission to its batch."""

    draw: int
    index: int  # among this process's groups of its draw step
    batch: EpisodeBatch
    version: int  # the student version it was admitted under
    started: float
    results: list[EpisodeResult | None]
    left: int  # live episodes still running
    first: int = 0  # the identity (row) of its first episode
    trajs: list | None = None  # once finished
    order: int = -1  # finish order


def split_groups(batch: EpisodeBatch, size: int) -> list[EpisodeBatch]:
    """``batch``'s rows as consecutive groups of ``size`` (each its own :class:`EpisodeBatch`)."""
    n = len(batch.episodes)
    if n % size:
        raise ValueError(f"{n} rollout rows on this process are not whole groups of env.group_size={size}; make "
                         "each process's rows (env.tasks_per_step * env.group_size / processes) a multiple of it")
    spec_of = dict(zip(batch.live, batch.specs))
    out = []
    for lo in range(0, n, size):
        live = [i for i in batch.live if lo <= i < lo + size]
        out.append(EpisodeBatch(batch.episodes[lo:lo + size], [i - lo for i in live], [spec_of[i] for i in live]))
    return out


class StepFeed:
    """The :class:`lopd_jax.rollout.episode_spec.EpisodeFeed` of a
    :class:`PartialRolloutPipeline` (see the module docstring)."""

    def __init__(self, pipe: "PartialRolloutPipeline", max_total: int):
        self.pipe, self.max_total = pipe, max_total
        self.next_draw = pipe.first_draw
        self.version = pipe.start  # the weights the engine runs (version ``start`` from the first call)
        self.groups: list[_Group] = []  # drawn, not yet in a batch
        self.where: dict[int, tuple[_Group, int]] = {}  # id(spec) -> (group, index among its live episodes)
        self.drawn: dict[int, int] = {}  # draw step -> this process's groups of it
        self.batch_log: dict[int, list[tuple[int, int]]] = {}  # batch -> its groups' (draw, index)
        self.next_batch = pipe.start
        self.quota = 0  # groups per batch on this process
        self.first_row = 0
        self.finished = 0
        self.waited = 0.0
        self.drops: list[EpisodeSpec] = []  # episodes of restarted groups the engine must drop
        self.restarts: list[_Group] = []  # restarted groups waiting to be admitted again
        self.restarted = 0  # rollouts restarted since the last batch

    def take_drops(self) -> list[EpisodeSpec]:
        drops, self.drops = self.drops, []
        return drops

    @property
    def cancelled(self) -> bool:
        return self.pipe._stop

    def more(self, idle: bool) -> FeedItem | None:
        pipe, swap = self.pipe, None
        if self.restarts:  # under at least the version the next batch needs
            swap = self._swap_to(max(self.version, sampling_version(self.next_batch, pipe.k, pipe.start)))
            if pipe._stop:
                return None
            specs = self._readmit()
            if specs:
                return FeedItem(specs, swap, self.version)
        while self.next_draw < pipe.num_steps and not pipe._stop:
            d = self.next_draw
            v = sampling_version(d, pipe.k, pipe.start)
            if v != self.version:
                if self.next_batch < v:  # the trainer still needs rollouts to make version v
                    if idle:
                        raise RuntimeError(f"partial rollouts: the engine is idle before draw step {d + 1} but "
                                           f"batch {self.next_batch + 1} is not delivered (a bug)")
                    break
                swap = self._swap_to(v)
                if pipe._stop:
                    return None
            specs = self._draw(d)
            if specs:
                return FeedItem(specs, swap, self.version)
        if swap is not None:
            return FeedItem(params=swap, version=self.version)
        if self.next_draw < pipe.num_steps or (pipe.stale == "restart" and self.next_batch < pipe.num_steps):
            return FeedItem()  # more to come (restart: a group may still be restarted)
        return None

    def _swap_to(self, v: int):
        """Wait for student version ``v`` (the trainer has what it needs to make it); its
        parameters, or None when the engine runs it already."""
        if v == self.version:
            return None
        pipe, t0 = self.pipe, time.perf_counter()
        with pipe._cond:
            while v not in pipe._versions and not pipe._stop:
                pipe._cond.wait()
            if pipe._stop:
                return None
            params = pipe._versions[v]
            for old in [u for u in pipe._versions if u < v]:
                del pipe._versions[old]
        self.waited += time.perf_counter() - t0
        self.version = v
        return params

    def _restart(self, group: _Group) -> None:
        """``stale=restart``: drop a group that would train more than k versions old (its
        episodes in flight are dropped, its environments closed) and queue it to start
        again under newer weights, with the same tasks, identities and keys."""
        self.groups.remove(group)
        for i, spec in enumerate(group.batch.specs):
            self.where.pop(id(spec), None)
            if group.results[i] is None:
                self.drops.append(spec)
        finish_episodes(group.batch, group.results, self.pipe.close_timeout, group.version)
        self.restarted += len(group.batch.episodes)
        self.restarts.append(group)

    def _readmit(self) -> list[EpisodeSpec]:
        """The restarted groups, prepared afresh under the current version."""
        specs, now = [], time.perf_counter()
        for old in self.restarts:
            part = self.pipe.prepare(old.draw, [ep.task for ep in old.batch.episodes], old.first)
            group = _Group(old.draw, old.index, part, self.version, now, [None] * len(part.specs), len(part.specs),
                           old.first)
            self._admit(group)
            specs += part.specs
        self.restarts = []
        return specs

    def _admit(self, group: _Group) -> None:
        self.groups.append(group)
        for i, spec in enumerate(group.batch.specs):
            self.where[id(spec)] = (group, i)
        if not group.batch.specs:  # every reset failed: finished already
            self._finished(group)

    def _draw(self, d: int) -> list[EpisodeSpec]:
        """Draw step ``d``'s tasks and admit this process's groups of them (less those a
        checkpoint says already trained); the specs to run."""
        pipe = self.pipe
        tasks = pipe.draw_tasks(d)
        with pipe._cond:
            pipe._task_states[d + 1] = pipe.task_state_fn()
        lo, hi = pipe.rows(len(tasks))
        batch, self.first_row = pipe.prepare(d, tasks[lo:hi], lo), lo
        parts = split_groups(batch, pipe.group_size)
        self.quota = len(parts)
        now, specs = time.perf_counter(), []
        with pipe._cond:
            self.next_draw += 1
            self.drawn[d] = len(parts)
        for j, part in enumerate(parts):
            if (d, j) in pipe.skip:
                finish_episodes(part, [None] * len(part.specs), 0.0, self.version)  # trained before the resume
                continue
            self._admit(_Group(d, j, part, self.version, now, [None] * len(part.specs), len(part.specs),
                               self.first_row + j * pipe.group_size))
            specs += part.specs
        return specs

    def ended(self, spec: EpisodeSpec, result: EpisodeResult) -> None:
        if id(spec) not in self.where:  # a restarted group's episode that ended before the engine dropped it
            return
        group, i = self.where.pop(id(spec))
        group.results[i] = result
        group.left -= 1
        if group.left == 0:
            self._finished(group)

    def _finished(self, group: _Group) -> None:
        group.trajs = finish_episodes(group.batch, group.results, self.pipe.close_timeout, group.version)
        group.order = self.finished
        self.finished += 1
        while self.next_batch < self.pipe.num_steps and self._deliver(self.next_batch):
            pass

    def _choose(self, s: int) -> list[_Group] | None:
        """Batch ``s``'s groups, or None while they are not all finished."""
        pipe = self.pipe
        if pipe.order == "step":
            if self.drawn.get(s) is None:
                return None
            chosen = [g for g in self.groups if g.draw == s]
            return chosen if all(g.trajs is not None for g in chosen) else None
        if not self.quota:
            return None
        if pipe.stale == "restart":  # stale groups were restarted: the first to finish
            rest = sorted((g for g in self.groups if g.trajs is not None), key=lambda g: g.order)[:self.quota]
            return sorted(rest, key=lambda g: (g.draw, g.index)) if len(rest) == self.quota else None
        # A group admitted under version a must train by step a + k. Step s must leave at most
        # (t - s) quotas of groups due by each step t > s, so it takes that many of the
        # earliest-due finished groups first (waiting when they have not finished), then
        # fills its quota in finish order.
        done = lambda g: g.trajs is not None  # noqa: E731
        chosen: list[_Group] = []
        for t in range(s, s + pipe.k + 1):
            pool = [g for g in self.groups if g.version + pipe.k <= t]
            need = len(pool) - (t - s) * self.quota
            if need > self.quota:
                raise RuntimeError(f"partial rollouts: {need} groups must train at step {s + 1}, over the quota "
                                   f"of {self.quota} (a bug)")
            have = sum(g.version + pipe.k <= t for g in chosen)
            if need > have:
                cands = sorted((g for g in pool if done(g) and g not in chosen), key=lambda g: g.order)
                if len(cands) < need - have:
                    return None
                chosen += cands[:need - have]
        rest = sorted((g for g in self.groups if done(g) and g not in chosen), key=lambda g: g.order)
        chosen += rest[:self.quota - len(chosen)]
        return sorted(chosen, key=lambda g: (g.draw, g.index)) if len(chosen) == self.quota else None

    def _deliver(self, s: int) -> bool:
        chosen = self._choose(s)
        if chosen is None:
            return False
        pipe = self.pipe
        self.groups = [g for g in self.groups if g not in chosen]
        trajs = [t for g in chosen for t in g.trajs]
        resampled = sum(len(g.trajs) for g in chosen if g.version != max(0, g.draw - pipe.k))
        info = {"first_row": self.first_row, "rollouts_restarted": self.restarted,
                "rollout_seconds": time.perf_counter() - min(g.started for g in chosen),
                "sampler_wait_seconds": self.waited, "rollouts_resampled_on_resume": resampled,
                "partial_rollouts": sum(t.latest_version != t.policy_version for t in trajs),
                "out_of_step_rollouts": sum(len(g.trajs) for g in chosen if g.draw != s)}
        self.waited, self.restarted = 0.0, 0
        with pipe._cond:
            self.batch_log[s] = [(g.draw, g.index) for g in chosen]
            self.next_batch = s + 1
            pipe._ready[s] = (trajs, info)
            pipe._cond.notify_all()
        if pipe.order == "finished" and pipe.stale == "restart" and s + 1 < pipe.num_steps:
            for g in [g for g in self.groups if g.version < s + 1 - pipe.k]:  # would train more than k behind
                self._restart(g)
        return True

    def resume_point(self, s: int) -> tuple[int, list[tuple[int, int]]]:
        """Before batch ``s``: the oldest draw step with a group of this process not in
        batches below ``s`` (or the next draw step) and the groups from it on that are."""
        with self.pipe._cond:
            trained = set(self.pipe.skip) | {x for b in range(self.pipe.start, s) for x in self.batch_log.get(b, ())}
            drawn = dict(self.drawn)
            nxt = self.next_draw
        waiting = [d for d, n in drawn.items() for j in range(n) if (d, j) not in trained]
        d0 = min(waiting + [nxt])
        return d0, sorted(x for x in trained if x[0] >= d0)

    def close_open(self) -> None:
        """Close the environments of groups not delivered (a cancelled run)."""
        for g in self.groups:
            if g.trajs is None:
                finish_episodes(g.batch, g.results, 0.0, g.version)
        self.groups = []


class PartialRolloutPipeline(RolloutPipeline):
    """Steps ``start .. num_steps - 1`` as one engine run on a background thread (see the
    module docstring). ``rows(n)`` gives this process's ``[lo, hi)`` of an ``n``-task draw
    step (:meth:`train.run_context.RunContext.task_rows`); ``prepare(d, tasks, first)``
    makes tasks of draw step ``d`` ready for the engine, the first one episode ``first``
    (:meth:`train.run_context.RunContext.prepare_rows`; also restarts a group);
    ``run_stream(params, feed)`` runs the engine over the feed; ``max_total`` caps an
    episode's tokens; ``close_timeout`` bounds closing a group's environments; ``order`` is
    ``rollout.batch_order``; ``first_draw`` the task iterator's step (below ``start`` after
    a resume in ``finished`` order) and ``skip`` the ``(draw, group)`` pairs already
    trained. The other arguments are :class:`train.async_rollouts.RolloutPipeline`'s. The
    held-out evaluation runs beside the stream on its own page pool (no engine lock)."""

    def __init__(self, rows: Callable[[int], tuple[int, int]], prepare: Callable[[int, list, int], EpisodeBatch],
                 run_stream: Callable[[Any, StepFeed], Any], max_total: int, close_timeout: float,
                 draw_tasks: Callable[[int], list], task_state: Callable[[], Any], start: int, num_steps: int,
                 k: int, params0, *, order: str = "step", group_size: int = 1, first_draw: int | None = None,
                 skip=(), stale: str = "wait"):
        self.rows, self.prepare, self.run_stream, self.close_timeout = rows, prepare, run_stream, close_timeout
        self.order, self.group_size, self.stale = order, group_size, stale
        self.skip = {tuple(x) for x in skip}
        self.feed: StepFeed | None = None
        self._max_total = max_total
        super().__init__(None, draw_tasks, task_state, start, num_steps, k, params0, first_draw=first_draw)

    def lock_engine_if(self, condition: bool):
        return super().lock_engine_if(False)

    def resume_point(self, s: int) -> tuple[int, list[tuple[int, int]]]:
        """``(draw step, groups trained from it on)`` a run resumed before step ``s``
        restarts from, for this process (``finished`` order; see :class:`StepFeed`)."""
        with self._cond:
            feed = self.feed
        return feed.resume_point(s) if feed is not None else (self.first_draw, sorted(self.skip))

    def iterator_state(self, d: int):
        """The task iterator's state before draw step ``d``."""
        with self._cond:
            return self._task_states[d]

    def _run(self) -> None:
        with self._cond:
            self.feed = feed = StepFeed(self, self._max_total)
        try:
            self.run_stream(self._versions[self.start], feed)
        except BaseException as e:  # handed to the trainer by get()
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            feed.close_open()
            with self._cond:
                if self._error is None and not self._stop and feed.next_batch < self.num_steps:
                    self._error = RuntimeError("partial rollouts: the engine run ended before every step's batch "
                                               "was delivered")
                self._cond.notify_all()
