"""The training stage of a run: rollouts of the current student, batches, updates, records.

:class:`TrainingStage` is the stage as the step loop's callbacks (:func:`train.stage_loop.run_steps`):
each step's data flows forward, the rollouts of the current student -> the step batch ->
one jitted update -> the step's record (:func:`training_step_record`: rollout statistics,
``rollouts_per_minute``, policy versions and staleness, the periodic held-out evaluation).
With ``rollout.mode=async`` the rollouts come from a background thread
(:class:`train.async_rollouts.RolloutPipeline`), up to ``rollout.max_staleness`` steps
ahead. :class:`ArmStage` is the training stage of every arm (:mod:`train.arms`).
:func:`log_rollouts` appends a step's rollouts to ``<workdir>/rollouts.jsonl``
(``rollout.log_rollouts``).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from typing import Any, Callable

import jax
import numpy as np

from lopd_jax.io.files import AppendFile, join
from lopd_jax.io.startup import host_rss_mb
from train import distributed, mesh as mesh_lib
from train.async_rollouts import PIPELINE_COUNTS, RolloutPipeline, copy_params, staleness_metrics
from train.partial_rollouts import PartialRolloutPipeline
from lopd_jax.settings.arm_config import rollouts_per_step
from train.arms.base import SUCCESS
from train.arms.registry import make_arm
from train.data import TaskPipeline
from train.run_context import RunContext
from train.stage_loop import evaluate_policy, log, run_steps

ROLLOUTS_FILE = "rollouts.jsonl"  # every training-stage rollout (any arm), with rollout.log_rollouts


def rollout_records(stage: str, step: int, trajs, first_row: int, process: int) -> list[dict]:
    """The ``rollouts.jsonl`` records of ``trajs``, rows ``first_row...`` produced by ``process``."""
    return [{"stage": stage, "step": int(step), "row": first_row + j, "process": process,
             "task_id": t.task.task_id, "tokens": t.tokens.tolist(), "mask": t.mask.tolist(),
             "reward": float(t.reward)} for j, t in enumerate(trajs)]


def write_rollouts(out, rows: list[dict]) -> None:
    """Append ``rows`` (records of :func:`rollout_records`) to ``out`` (None: not process 0)."""
    if out is not None:
        out.write("".join(json.dumps(r) + "\n" for r in rows))


def log_rollouts(out, stage: str, step: int, trajs, first_row: int) -> None:
    """Append this step's rollouts (every host's, gathered to all, written by process 0) to
    ``out`` (an :class:`lopd_jax.io.files.AppendFile` of ``<workdir>/rollouts.jsonl``, local or
    ``gs://``; None on other processes): row, producing process, task, ids, mask, reward."""
    mine = rollout_records(stage, step, trajs, first_row, jax.process_index())
    write_rollouts(out, distributed.allgather_list(mine))


def _engine_times(local: dict) -> dict:
    """The rollout engine's time records of a step (:meth:`TrainingStage.sample`)."""
    return {k: v for k, v in local.items() if k.startswith("rollout_engine_")}


def training_step_record(ctx: RunContext, writer, label: str, step: int, metrics: dict, rollout_info: dict,
                         policy_params: Callable[[], Any], engine_lock=None) -> dict:
    """What a training stage adds to step ``step``'s record: its rollout information with
    ``rollouts_per_minute`` (rollout phase only) and the host's resident memory
    (``host_rss_mb``); runs and writes the periodic held-out
    evaluation (``stages.eval_every``) of ``policy_params()``, holding ``engine_lock`` (the
    asynchronous rollouts' engine, if any) meanwhile. Drops ``mean_reward`` from ``metrics``
    (the rollout information carries the reward)."""
    cfg = ctx.cfg
    extra = dict(rollout_info)
    extra["rollouts_per_minute"] = 60.0 * extra["rollouts"] / max(extra["rollout_seconds"], 1e-9)
    extra["host_rss_mb"] = host_rss_mb()  # host memory over a long run
    metrics.pop("mean_reward", None)
    done = step + 1
    if cfg.stages.eval_every and done % cfg.stages.eval_every == 0 and done < cfg.stages.lopd_steps:
        with engine_lock or nullcontext():
            ev = evaluate_policy(ctx, policy_params(), step=done)
        writer.write(done, "eval", ev)
        log(f"{label} step {done}: held-out reward {ev['reward_mean']:.3f}")
    return extra


class TrainingStage:
    """A training stage as the step loop's callbacks (stage name ``lopd`` for every arm, so
    metrics, checkpoints and export are shared). Each step's data flows forward: the
    rollouts of the current student (:meth:`rollout`) -> the step batch (:meth:`make_batch`)
    -> one jitted update (:meth:`make_step`, compiled on the first batch) -> the step's
    record (:meth:`record`: rollout statistics, periodic held-out evaluation). ``state``
    is the newest train state; the task iterator's state and the bank path go into every
    checkpoint's metadata (:meth:`meta`).

    ``rollout.mode=sync``: step s's rollouts sample the current student (version s, its
    update count). ``async``: a :class:`train.async_rollouts.RolloutPipeline` samples them
    with version max(0, s - k) on a background thread while earlier steps train
    (``rollout.partial``: one engine run across steps, :class:`train.partial_rollouts.
    PartialRolloutPipeline`); the batch is built on the trainer's thread. Every trajectory carries its ``policy_version``.
    Subclass: :class:`ArmStage`.
    """

    label = "lopd"  # names the stage's log lines

    def __init__(self, ctx: RunContext, state, frozen, shardings, tasks_per_step: int, group_size: int,
                 bank_path: str, writer):
        self.ctx, self.frozen, self.shardings, self.writer = ctx, frozen, shardings, writer
        self.bank_path, self.group_size, self.tasks_per_step = bank_path, group_size, tasks_per_step
        self.state = mesh_lib.put(state, shardings)
        # the global task list of a step on every process (one iterator state for all hosts)
        self.tasks = iter(TaskPipeline(ctx.train_tasks, tasks_per_step, seed=ctx.cfg.seed, process_index=0,
                                       process_count=1))
        self.key = jax.random.key(ctx.cfg.seed)
        self._jitted = None
        self._rollout_info: dict[int, dict] = {}  # a step's rollout statistics, until its record
        self.log_rollouts = ctx.cfg.rollout.log_rollouts
        self.rollout_log = None  # the open AppendFile of rollouts.jsonl during run() (process 0)
        self.mode, self.max_staleness = ctx.cfg.rollout.mode, ctx.cfg.rollout.max_staleness
        self.pipeline: RolloutPipeline | None = None  # async: started by the first batch()
        self.version = 0  # async: the current student's version (its update count)
        self._trained_ahead = None  # finished-order partial rollouts: per process, groups trained before a resume
        self._built = -1  # the last step whose batch was built (one ahead of the update with may_prefetch)

    # ----- what subclasses give -----
    def gather(self, s: int, trajs: list, local: dict) -> tuple[list, dict]:
        """From this process's rollouts of step ``s`` (:meth:`sample`; ``local``: its
        ``first_row`` and ``rollout_seconds``): the trajectories :meth:`make_batch` takes and
        the rollout statistics of every host's rows. Runs the step's host collectives, so it
        runs on the trainer's thread in both modes."""
        raise NotImplementedError

    def make_batch(self, s: int, trajs) -> dict:
        """The step batch (numpy, this process's rows) of step ``s``'s trajectories."""
        raise NotImplementedError

    def make_step(self, state, batch) -> Callable:
        """The jitted ``(state, frozen, batch) -> (state, metrics)`` update."""
        raise NotImplementedError

    def after_step(self, metrics):
        """What the update's metrics become before the loop logs them (default: unchanged)."""
        return metrics

    # ----- rollouts -----
    def sample(self, s: int, tasks: list, params) -> tuple[list, dict]:
        """This process's rows of step ``s``'s ``tasks`` (:meth:`step_tasks`) under the
        sampler parameters ``params`` (:meth:`sampler_params`), with ``{"first_row",
        "rollout_seconds"}``. No host collective: in async it runs on the rollout thread."""
        t0 = time.perf_counter()
        trajs, first_row = self.ctx.rollout_split(params, tasks, jax.random.fold_in(self.key, s))
        timing = self.ctx.engine.last_timing  # this process's engine: host vs device-wait seconds
        return trajs, {"first_row": first_row, "rollout_seconds": time.perf_counter() - t0,
                       **(timing.record(prefix="rollout_engine_") if timing is not None else {})}

    def rollout(self, s: int, tasks: list, params) -> tuple[list, dict]:
        """``(trajectories, rollout statistics)`` of step ``s``: :meth:`sample` then :meth:`gather`."""
        return self.gather(s, *self.sample(s, tasks, params))

    def sampler_params(self, student) -> dict:
        """The engine's parameters of ``student`` on their own buffers (the update donates
        the state), laid out on this process's engine devices: a collective when they span
        hosts, so it runs on the trainer's thread, on every process alike."""
        return self.ctx.engine.local_params(self.ctx.policy_params(copy_params(student), self.frozen))

    # ----- the step loop's callbacks -----
    def step_tasks(self, s: int) -> list:
        """Step ``s``'s tasks as they stand at ``s`` (the task source's ``at_step``), each
        repeated ``group_size`` times (the iterator must be at ``s``)."""
        if self.tasks.step != s:
            raise RuntimeError(f"the task iterator is at step {self.tasks.step}, the loop at {s}")
        return [t for t in self.ctx.source.at_step(next(self.tasks), s) for _ in range(self.group_size)]

    def student_params(self) -> dict:
        """The sampler's parameters of the current student."""
        return self.ctx.policy_params(self.state["student"], self.frozen)

    def batch(self, s: int) -> dict:
        """Step ``s``'s rollouts (sync: sampled now by the current student; async: taken
        from the rollout thread) and its batch; the rollout statistics,
        :func:`train.async_rollouts.staleness_metrics` and ``batch_host_seconds`` (the host
        seconds of :meth:`make_batch`) wait for :meth:`record`."""
        if self.mode == "sync":
            trajs, info = self.rollout(s, self.step_tasks(s), self.student_params())
            for t in trajs:
                t.policy_version = t.latest_version = s
            versions = [s] * len(trajs)
        else:
            if self.pipeline is None:
                self.start_pipeline(s)
            trajs, local = self.pipeline.get(s)
            trajs, info = self.gather(s, trajs, local)
            # the pipeline's counts and versions are this process's rows: the record has every host's
            parts = distributed.allgather_objects(({k: local[k] for k in PIPELINE_COUNTS if k in local},
                                                   [t.policy_version for t in trajs]))
            versions = [v for _, vs in parts for v in vs]
            info = {**{k: v for k, v in local.items() if k != "first_row"}, **info,
                    **{k: sum(c[k] for c, _ in parts) for k in parts[0][0]}}
        t0 = time.perf_counter()
        batch = self.make_batch(s, trajs)
        # host seconds of the batch (pack plan, packed arrays, teacher rows, retrieval, composer
        # inputs); the step's device seconds are the loop's train_seconds (dispatch to metrics)
        self._rollout_info[s] = {**info, **staleness_metrics(versions, s),
                                 "batch_host_seconds": time.perf_counter() - t0}
        self._built = s
        return batch

    def start_pipeline(self, start: int) -> None:
        """Start the asynchronous rollouts of steps ``start...`` from the current student
        (version ``start``); versions below ``start`` of a resumed run are gone (logged)."""
        k, n = self.max_staleness, self.ctx.cfg.stages.lopd_steps
        self.version = start
        if start > 0 and k > 0:
            lost = min(k, n - start)
            log(f"{self.label}: async rollouts resumed at step {start}: the rollouts of the next {lost} step(s), "
                f"sampled ahead before the interruption, are re-sampled with the restored student (version "
                f"{start}) rather than versions {max(0, start - k)}..{start - 1} (counted in "
                "rollouts_resampled_on_resume)")
        params0 = self.sampler_params(self.state["student"])
        ro = self.ctx.cfg.rollout
        if ro.partial:
            engine = self.ctx.engine
            skip = (self._trained_ahead or [[]] * jax.process_count())[jax.process_index()]
            if start > 0 and ro.batch_order == "finished":
                log(f"{self.label}: partial rollouts resumed at step {start}: tasks are drawn again from draw step "
                    f"{self.tasks.step + 1}, less the {len(skip)} group(s) of this process already trained")
            self.pipeline = PartialRolloutPipeline(
                self.ctx.task_rows,
                lambda d, tasks, first: self.ctx.prepare_rows(tasks, jax.random.fold_in(self.key, d), first),
                lambda params, feed: engine.run(params, [], jax.random.fold_in(self.key, start), feed=feed,
                                                version=start),
                ro.caps.max_total_tokens, engine.config.env_timeout_s, self.step_tasks, self.tasks.get_state,
                start, n, k, params0, order=ro.batch_order, group_size=self.group_size, first_draw=self.tasks.step,
                skip=skip, stale=ro.stale)
        else:
            self.pipeline = RolloutPipeline(self.sample, self.step_tasks, self.tasks.get_state, start, n, k, params0)

    def may_prefetch(self, s: int) -> bool:
        """Whether step ``s + 1``'s batch may be built while step ``s``'s update runs
        (:func:`train.stage_loop.run_steps`' ``prefetch``): with asynchronous whole-step
        rollouts only. Sync rollouts sample step ``s``'s output (nothing to overlap) and a
        checkpoint's task-iterator state must not have drawn step ``s + 1``'s tasks; partial
        rollouts' resume point counts the groups the trainer has taken."""
        return type(self.pipeline) is RolloutPipeline

    def close_pipeline(self) -> None:
        """Stop the rollout thread; say how many steps' rollouts sampled ahead were dropped
        (a batch built ahead and not trained on included)."""
        if self.pipeline is None:
            return
        dropped = self.pipeline.close() + max(0, self._built - self.version + 1)
        self.pipeline = None
        if dropped:
            log(f"{self.label}: {dropped} step(s) of rollouts sampled ahead were not trained on; a resumed run "
                "re-samples them")

    def step(self, state, batch):
        """One update; the new state is the student of the next rollout (async: published
        to the rollout thread when a later step samples it)."""
        if self._jitted is None:
            self._jitted = self.make_step(state, batch)
        state, metrics = self._jitted(state, self.frozen, batch)
        self.state = state
        metrics = self.after_step(metrics)
        if self.pipeline is not None:
            self.version += 1
            if self.pipeline.wants(self.version):
                self.pipeline.publish(self.version, self.sampler_params(state["student"]))
        return state, metrics

    def record(self, s: int, metrics: dict) -> dict:
        """Step ``s``'s record (:func:`training_step_record`)."""
        lock = None
        if self.pipeline is not None:
            every = self.ctx.cfg.stages.eval_every
            lock = self.pipeline.lock_engine_if(bool(every) and (s + 1) % every == 0)
        return training_step_record(self.ctx, self.writer, self.label, s, metrics, self._rollout_info.pop(s),
                                    self.student_params, lock)

    def meta(self, s: int) -> dict:
        """Checkpoint metadata: the task iterator's state (before step ``s``'s tasks) and
        the bank's path; with finished-order partial rollouts, the iterator's state before
        the oldest draw step with a group not yet trained and, per process, the groups
        after it already trained (``trained_ahead``; a collective)."""
        if isinstance(self.pipeline, PartialRolloutPipeline) and self.pipeline.order == "finished":
            parts = distributed.allgather_objects(self.pipeline.resume_point(s))  # every process's
            d0 = min(d for d, _ in parts)
            return {"data": self.pipeline.iterator_state(d0), "bank": self.bank_path,
                    "trained_ahead": [[list(x) for x in trained if x[0] >= d0] for _, trained in parts]}
        data = self.pipeline.task_state(s) if self.pipeline is not None else self.tasks.get_state()
        return {"data": data, "bank": self.bank_path}

    def restore(self, state, meta: dict) -> None:
        """Continue from a restored checkpoint (the next rollout samples its student)."""
        self.state = state
        self.tasks.set_state(meta["data"])
        self._trained_ahead = meta.get("trained_ahead")

    def run(self):
        """Run (or resume) the stage's ``stages.lopd_steps`` steps; ``(state, preempted)``.
        With ``rollout.log_rollouts``, ``<workdir>/rollouts.jsonl`` is open meanwhile on
        process 0 (``self.rollout_log``; a ``gs://`` object is rewritten every 30 s and when
        the stage ends)."""
        if self.log_rollouts and jax.process_index() == 0:
            self.rollout_log = AppendFile(join(self.ctx.cfg.workdir, ROLLOUTS_FILE))
        try:
            return run_steps(self.ctx, "lopd", self.state, self.ctx.cfg.stages.lopd_steps, self.step, self.batch,
                             shardings=self.shardings, extra_meta=self.meta, writer=self.writer,
                             on_metrics=self.record, on_restore=self.restore, prefetch=self.may_prefetch)
        finally:
            self.close_pipeline()
            if self.rollout_log is not None:
                self.rollout_log.close()
                self.rollout_log = None


class ArmStage(TrainingStage):
    """The training stage of every arm: the shared loop with the run's arm
    (:class:`train.arms.base.Arm`, looked up by ``cfg.arm``) giving the batch, the step,
    what it adds to the state, the records and the checkpoint metadata.

    Multi-host: each process rolls out only the rows it owns. An arm whose batch needs
    every row (``Arm.all_rows``: group advantages, SDPO's sibling, Skill-SD's UCB1 choice,
    SDFT's demonstration) gets every row's trajectory gathered to every process in row
    order, builds the batch identically on every host and each process keeps its own rows
    of every per-row array (:meth:`make_batch`); the step's metrics are global
    (replicated), so host state updated from them (Skill-SD's UCB1 counts) stays the same
    on every process. Otherwise (LOPD) each process builds the batch of its own rows and
    only the statistics are gathered."""

    def __init__(self, ctx: RunContext, bank, bank_path: str, composer0, writer):
        cfg, system = ctx.cfg, ctx.system
        arm = make_arm(ctx, bank)
        state, frozen = system.init_state(composer=composer0, seed=cfg.seed)
        state = arm.add_state(cfg, state)
        G, n_roll = arm.group_size, rollouts_per_step(cfg)
        if arm.all_rows and n_roll % ctx.batch_shards:
            raise ValueError(f"{n_roll} rollouts per step do not split over {ctx.batch_shards} batch "
                             "shards; make env.tasks_per_step * env.group_size a multiple of mesh.data * mesh.fsdp.")
        super().__init__(ctx, state, frozen, arm.shardings(state), n_roll // G, G, bank_path, writer)
        self.arm, self.label, self.rows = arm, arm.name, n_roll

    def gather(self, s: int, trajs: list, local: dict) -> tuple[list, dict]:
        """The trajectories of step ``s`` the arm's batch takes (every row's, gathered in
        row order, or this process's) and every host's rollout statistics."""
        if not self.arm.all_rows:
            return self._gather_stats(s, trajs, local)
        parts = distributed.allgather_objects(trajs)  # every process's rows, in process (= row) order
        every = [t for part in parts for t in part]
        if len(every) != self.rows:
            raise ValueError(f"gathered {len(every)} of {self.rows} rollouts of step {s + 1}")
        info = {"rollouts": len(every), "rollout_seconds": local["rollout_seconds"], **_engine_times(local),
                "reward_mean": float(np.mean([t.reward for t in every])),
                "success_rate": float(np.mean([t.reward >= SUCCESS for t in every])),
                "mean_length": float(np.mean([len(t) for t in every]))}
        if self.log_rollouts:
            rows, row = [], 0
            for p, part in enumerate(parts):
                rows += rollout_records("lopd", s + 1, part, row, p)
                row += len(part)
            write_rollouts(self.rollout_log, rows)
        return every, info

    def _gather_stats(self, s: int, trajs: list, local: dict) -> tuple[list, dict]:
        """This process's rows of step ``s``'s rollouts and every host's statistics."""
        n = len(trajs) * jax.process_count()
        if n != self.tasks_per_step * self.group_size:
            raise ValueError(f"{self.tasks_per_step * self.group_size} rollouts per step do not split evenly over "
                             f"{jax.process_count()} processes' batch rows; make env.tasks_per_step * "
                             "env.group_size a multiple of mesh.data * mesh.fsdp.")
        stats = distributed.allgather_list([(t.reward, len(t)) for t in trajs])  # every host's rows, in order
        info = {"rollouts": len(stats), "rollout_seconds": local["rollout_seconds"], **_engine_times(local),
                "reward_mean": float(np.mean([r for r, _ in stats])),
                "success_rate": float(np.mean([r >= SUCCESS for r, _ in stats])),
                "mean_length": float(np.mean([n for _, n in stats]))}
        if self.log_rollouts:
            log_rollouts(self.rollout_log, "lopd", s + 1, trajs, local["first_row"])
        return trajs, info

    def make_batch(self, s: int, trajs):
        """The arm's batch of step ``s``: with ``Arm.all_rows``, this process's rows of it
        (:meth:`train.run_context.RunContext.local_rows`; a length-bucketed batch puts its own)."""
        batch = self.arm.batch(s, trajs)
        if not self.arm.all_rows or not isinstance(batch, dict):
            return batch
        lo, hi = self.ctx.local_rows(self.rows)
        if (lo, hi) == (0, self.rows):
            return batch
        for k, v in batch.items():
            if np.shape(v)[:1] != (self.rows,):
                raise ValueError(f"batch entry {k!r} has shape {np.shape(v)}, not {self.rows} rows first")
        return {k: np.asarray(v)[lo:hi] for k, v in batch.items()}

    def make_step(self, state, batch) -> Callable:
        """The arm's jitted step."""
        return self.arm.make_step(state, batch)

    def after_step(self, metrics):
        """The metrics after the arm has read them (Skill-SD's UCB1 update)."""
        return self.arm.after_step(metrics)

    def record(self, s: int, metrics: dict) -> dict:
        """The shared record plus the arm's own (LOPD: ``composer_version``, ``bank_entries``)."""
        return {**super().record(s, metrics), **self.arm.record(s)}

    def meta(self, s: int) -> dict:
        """The shared metadata plus the arm's name and its own state."""
        return {**super().meta(s), "arm": self.arm.name, **self.arm.meta()}

    def restore(self, state, meta: dict) -> None:
        """Continue from a restored checkpoint, the arm's own state included."""
        super().restore(state, meta)
        self.arm.restore(meta)
