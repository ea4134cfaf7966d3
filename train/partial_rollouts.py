"""Partial rollouts (``rollout.partial=true`` with ``rollout.mode=async``): one engine run
across the steps of a training stage, its slots kept full from step to step.

:class:`PartialRolloutPipeline` has :class:`train.async_rollouts.RolloutPipeline`'s
trainer side (``publish`` / ``get`` / ``task_state`` / ``close``) but runs a single
:meth:`lopd_jax.rollout.engine.Engine.run` on its thread, fed step by step by
:class:`StepFeed`. Step ``s``'s episodes are admitted as soon as the engine has room and
the student of version ``v(s) = max(start, s - k)`` is published; admitting them swaps the
weights of every episode in flight to ``v(s)`` (their caches, computed under older weights,
are kept). So a slow episode of step ``s`` no longer holds the engine: steps ``s + 1 ..
s + k`` decode beside it. Each token records the version that sampled it; a trajectory's
``policy_version`` is its oldest token's, ``latest_version`` its newest. Step ``s``'s
tokens all come from versions ``v(s) .. s``, so staleness stays at most ``k``.

Swaps happen only when the feed is asked for work, and the feed waits for ``v(s)`` only
once every step below ``v(s)`` has been delivered (the trainer then has what it needs to
make it): with environment steps run on the engine's thread (``engine.env_workers=0``,
latency counted in engine steps) the run is a function of the seed. With step threads the
swap points depend on timing; the batches' tasks do not. docs/rl_step.md, "Partial
rollouts".
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from lopd_jax.rollout.episode_spec import EpisodeResult, EpisodeSpec, FeedItem
from lopd_jax.rollout.episodes import EpisodeBatch, finish_episodes
from train.async_rollouts import RolloutPipeline, sampling_version


@dataclasses.dataclass
class _OpenStep:
    """A step whose episodes are in the engine."""

    batch: EpisodeBatch
    first_row: int
    version: int
    waited: float
    started: float
    results: list[EpisodeResult | None]
    left: int
    tasks: int  # the step's tasks on every process


class StepFeed:
    """The :class:`lopd_jax.rollout.episode_spec.EpisodeFeed` of a
    :class:`PartialRolloutPipeline`: the steps' episodes in step order, each step's under
    its sampling version (see the module docstring)."""

    def __init__(self, pipe: "PartialRolloutPipeline", max_total: int):
        self.pipe, self.max_total = pipe, max_total
        self.next_step = pipe.start
        self.version = pipe.start  # the weights the engine runs (version ``start`` from the first call)
        self.open: dict[int, _OpenStep] = {}
        self.where: dict[int, tuple[int, int]] = {}  # id(spec) -> (step, index among its live episodes)
        self.delivered: set[int] = set()

    @property
    def cancelled(self) -> bool:
        return self.pipe._stop

    def more(self, idle: bool) -> FeedItem | None:
        pipe, swap = self.pipe, None
        while self.next_step < pipe.num_steps and not pipe._stop:
            s = self.next_step
            v = sampling_version(s, pipe.k, pipe.start)
            waited = 0.0
            if v != self.version:
                if any(t not in self.delivered for t in range(pipe.start, v)):  # the trainer still needs rollouts
                    if idle:
                        raise RuntimeError(f"partial rollouts: the engine is idle before step {s + 1} but steps "
                                           f"below {v + 1} are not delivered (a bug)")
                    return FeedItem(params=swap, version=self.version) if swap is not None else FeedItem()
                t0 = time.perf_counter()
                with pipe._cond:
                    while v not in pipe._versions and not pipe._stop:
                        pipe._cond.wait()
                    if pipe._stop:
                        return None
                    swap = pipe._versions[v]
                    for old in [u for u in pipe._versions if u < v]:
                        del pipe._versions[old]
                waited = time.perf_counter() - t0
                self.version = v
            tasks = pipe.draw_tasks(s)
            with pipe._cond:
                pipe._task_states[s + 1] = pipe.task_state_fn()
            batch, first_row = pipe.prepare(s, tasks)
            self.next_step += 1
            step = _OpenStep(batch, first_row, v, waited, time.perf_counter(), [None] * len(batch.specs),
                             len(batch.specs), len(tasks))
            self.open[s] = step
            for j, spec in enumerate(batch.specs):
                self.where[id(spec)] = (s, j)
            if not batch.specs:  # every reset failed: the step is done already
                self._deliver(s)
                continue
            return FeedItem(batch.specs, swap, self.version)
        return None if swap is None else FeedItem(params=swap, version=self.version)

    def ended(self, spec: EpisodeSpec, result: EpisodeResult) -> None:
        s, j = self.where.pop(id(spec))
        step = self.open[s]
        step.results[j] = result
        step.left -= 1
        if step.left == 0:
            self._deliver(s)

    def _deliver(self, s: int) -> None:
        step = self.open.pop(s)
        pipe = self.pipe
        trajs = finish_episodes(step.batch, step.results, pipe.close_timeout, step.version)
        info = {"first_row": step.first_row, "rollout_seconds": time.perf_counter() - step.started,
                "sampler_wait_seconds": step.waited,
                "rollouts_resampled_on_resume": step.tasks if step.version != max(0, s - pipe.k) else 0,
                "partial_rollouts": sum(t.latest_version != t.policy_version for t in trajs)}
        self.delivered.add(s)
        with pipe._cond:
            pipe._ready[s] = (trajs, info)
            pipe._cond.notify_all()

    def close_open(self) -> None:
        """Close the environments of steps still in the engine (a cancelled run)."""
        for s in list(self.open):
            step = self.open.pop(s)
            finish_episodes(step.batch, step.results, 0.0, step.version)


class PartialRolloutPipeline(RolloutPipeline):
    """Steps ``start .. num_steps - 1`` as one engine run on a background thread (see the
    module docstring). ``prepare(s, tasks)`` gives this process's prepared episodes of step
    ``s`` and its first row (:meth:`train.run_context.RunContext.prepare_split`);
    ``run_stream(params, feed)`` runs the engine over the feed; ``max_total`` caps an
    episode's tokens; ``close_timeout`` bounds closing a step's environments. The other
    arguments are :class:`train.async_rollouts.RolloutPipeline`'s. The held-out evaluation
    runs beside the stream on its own page pool (no engine lock)."""

    def __init__(self, prepare: Callable[[int, list], tuple[EpisodeBatch, int]],
                 run_stream: Callable[[Any, StepFeed], Any], max_total: int, close_timeout: float,
                 draw_tasks: Callable[[int], list], task_state: Callable[[], Any], start: int, num_steps: int,
                 k: int, params0):
        self.prepare, self.run_stream, self.close_timeout = prepare, run_stream, close_timeout
        self.feed: StepFeed | None = None
        self._max_total = max_total
        super().__init__(None, draw_tasks, task_state, start, num_steps, k, params0)

    def lock_engine_if(self, condition: bool):
        return super().lock_engine_if(False)

    def _run(self) -> None:
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
                if self._error is None and not self._stop and len(feed.delivered) < self.num_steps - self.start:
                    self._error = RuntimeError("partial rollouts: the engine run ended before every step was "
                                               "delivered")
                self._cond.notify_all()
