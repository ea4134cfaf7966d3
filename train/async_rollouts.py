"""Asynchronous rollouts (``rollout.mode=async``): bounded-staleness pipelining on the same chips.

:class:`RolloutPipeline` runs a training stage's rollouts on a background thread while the
trainer updates the student: step s's rollouts sample the student after
:func:`sampling_version` updates (max(0, s - k), k = ``rollout.max_staleness``), waiting
until the trainer has published that version, so which weights sampled what is a function
of the seed alone, whatever the environments' latency. Tasks and rollout keys are sync's.
A resumed run lost the versions below its restored step r: steps r .. r+k-1 sample version r
(``rollouts_resampled_on_resume``). :func:`staleness_metrics` is the step record's part.
docs/rl_step.md, "Asynchronous rollouts".
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np



def sampling_version(step: int, k: int, start: int = 0) -> int:
    """The student version (its update count) that samples step ``step``'s rollouts with
    staleness bound ``k`` in a run (re)started at step ``start``: ``max(0, step - k)``, or
    ``start`` when that version was lost with a preemption (it is older than the restored
    student)."""
    return max(start, step - k, 0)


# a pipeline's per-step counts of this process's rollouts, summed over processes for the record
PIPELINE_COUNTS = ("rollouts_resampled_on_resume", "rollouts_restarted", "partial_rollouts", "out_of_step_rollouts")


def staleness_metrics(versions, step: int) -> dict[str, float]:
    """Step ``step``'s record of its batch's policy ``versions`` (every rollout's
    ``Trajectory.policy_version``): ``policy_version`` (the trainer's student version, i.e.
    ``step``) and the staleness (``step`` minus each version) mean, 95th percentile and max."""
    stale = np.asarray([step - v for v in versions], np.float64)
    if stale.size == 0:
        stale = np.zeros(1)
    return {"policy_version": float(step), "staleness_mean": float(stale.mean()),
            "staleness_p95": float(np.percentile(stale, 95)), "staleness_max": float(stale.max())}


def copy_params(tree):
    """A copy of ``tree`` on its own buffers (the train step donates the state it reads)."""
    return jax.tree.map(jnp.copy, tree)


class RolloutPipeline:
    """The rollouts of steps ``start .. num_steps - 1`` on a background thread, up to ``k``
    steps ahead of the trainer.

    ``draw_tasks(s)`` gives step s's tasks (the stage's task iterator, drawn in step order
    on the thread); ``task_state()`` the iterator's state; ``rollout_fn(s, tasks, params)``
    the stage's ``(trajectories, statistics)``. The trainer :meth:`publish` es each new
    student version it will need, and takes each step's rollouts with :meth:`get`. Each
    trajectory is stamped with the version that sampled it; the statistics gain
    ``sampler_wait_seconds`` (the thread waiting for that version), ``trainer_wait_seconds``
    (:meth:`get` waiting for the rollouts) and ``rollouts_resampled_on_resume``.
    ``engine_lock`` is held during each rollout: other users of the engine (the held-out
    evaluation) take it too. ``first_draw``: the task iterator's step when the pipeline
    starts (``start`` unless a subclass draws from earlier).
    """

    def __init__(self, rollout_fn: Callable, draw_tasks: Callable[[int], list], task_state: Callable[[], Any],
                 start: int, num_steps: int, k: int, params0, first_draw: int | None = None):
        self.rollout_fn, self.draw_tasks, self.task_state_fn = rollout_fn, draw_tasks, task_state
        self.start, self.num_steps, self.k = start, num_steps, k
        self.first_draw = start if first_draw is None else first_draw  # the task iterator's step
        self.engine_lock = threading.Lock()
        self._cond = threading.Condition()
        self._versions: dict[int, Any] = {start: params0}  # published student versions not yet used
        self._ready: dict[int, tuple[list, dict]] = {}
        self._task_states: dict[int, Any] = {self.first_draw: task_state()}  # before draw step d's tasks
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="async-rollouts", daemon=True)
        self._thread.start()

    # ----- the trainer's side -----
    def wants(self, version: int) -> bool:
        """Whether a later step samples student ``version`` (only those are published)."""
        return any(sampling_version(s, self.k, self.start) == version
                   for s in range(max(self.start, version), min(version + self.k + 1, self.num_steps)))

    def publish(self, version: int, params) -> None:
        """Make student ``version``'s sampler parameters (their own buffers) available."""
        with self._cond:
            self._versions[version] = params
            self._cond.notify_all()

    def get(self, s: int) -> tuple[list, dict]:
        """Step ``s``'s ``(trajectories, statistics)``, waiting for the thread if needed."""
        t0 = time.perf_counter()
        with self._cond:
            while s not in self._ready and self._error is None:
                self._cond.wait()
            if s not in self._ready:
                raise RuntimeError(f"the rollout thread failed before step {s + 1}'s rollouts") from self._error
            trajs, info = self._ready.pop(s)
        info["trainer_wait_seconds"] = time.perf_counter() - t0
        return trajs, info

    def task_state(self, s: int):
        """The task iterator's state before step ``s``'s tasks were drawn (checkpoint metadata)."""
        with self._cond:
            if s not in self._task_states:
                raise RuntimeError(f"no task-iterator state for step {s} (the rollout thread is at "
                                   f"{max(self._task_states)})")
            return self._task_states[s]

    def lock_engine_if(self, condition: bool):
        """:attr:`engine_lock` when ``condition`` holds, else a no-op context."""
        return self.engine_lock if condition else nullcontext()

    def close(self) -> int:
        """Stop the thread (after the rollout under way); returns the steps whose rollouts
        were sampled ahead and never trained on."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        return len(self._ready)

    # ----- the thread -----
    def _run(self) -> None:
        try:
            for s in range(self.start, self.num_steps):
                tasks = self.draw_tasks(s)
                version = sampling_version(s, self.k, self.start)
                t0 = time.perf_counter()
                with self._cond:
                    self._task_states[s + 1] = self.task_state_fn()
                    while version not in self._versions and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    params = self._versions[version]
                waited = time.perf_counter() - t0
                with self.engine_lock:
                    trajs, info = self.rollout_fn(s, tasks, params)
                for t in trajs:
                    t.policy_version = t.latest_version = version
                info["sampler_wait_seconds"] = waited
                info["rollouts_resampled_on_resume"] = len(trajs) if version != max(0, s - self.k) else 0
                with self._cond:
                    self._ready[s] = (trajs, info)
                    nxt = sampling_version(s + 1, self.k, self.start)
                    for v in [v for v in self._versions if v < nxt]:
                        del self._versions[v]
                    self._cond.notify_all()
        except BaseException as e:  # handed to the trainer by get()
            with self._cond:
                self._error = e
                self._cond.notify_all()
