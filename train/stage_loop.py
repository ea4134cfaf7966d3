"""What every stage with steps runs on: the resumable step loop (:func:`run_steps`, with
:func:`put_batch`), the held-out evaluation (:func:`evaluate_policy`) and the progress log.

:func:`train.loop.run` orchestrates the stages; :mod:`train.training_stage` and
:mod:`train.arms` run their steps here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from lopd_jax.io.progress import Pulse, format_seconds
from lopd_jax.method.eval_stats import behaviour_stats, no_tool_baseline
from train.checkpoint import Checkpointer, preemption_agreed
from train.distributed import global_array
from train.metrics import Progress
from train.nonfinite import NonFiniteTracker
from train.oracle_scores import KEY as ORACLE_ARG, oracle_argument_probs
from train.run_context import RunContext
from train.run_reader import restore_newest

EVAL_RNG_OFFSET = 1 << 21


def log(msg: str) -> None:
    """One progress line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        print(f"[lopd] {msg}", file=sys.stderr, flush=True)


def first_step_pulse(stage: str, first: bool):
    """On process 0, for a stage's first step in this process: a line now and every 30 s saying
    that it compiles (its batch's rollouts and the step function); else a no-op context."""
    if not first or jax.process_index() != 0:
        return contextlib.nullcontext()
    return Pulse(lambda t: f"[lopd] {stage}: first step: compiling the {stage} step and its rollouts (first step "
                           f"only; the compilation cache makes reruns quick), {format_seconds(t)}")


def evaluate_policy(ctx: RunContext, params, step: int = 0) -> dict[str, Any]:
    """Greedy rollouts of the held-out tasks as they stand after ``step`` training steps
    (the task source's ``at_step``): mean reward, success rate, Table-3 stats and the
    per-task outcomes (:func:`per_task_outcomes`); on hidden-rule families also the
    teacher-forced probability of the oracle argument (:mod:`train.oracle_scores`), per task
    and as ``oracle_arg_prob``."""
    greedy = dataclasses.replace(ctx.cfg.rollout.sampling, temperature=0.0)
    key = jax.random.fold_in(jax.random.key(ctx.cfg.seed), EVAL_RNG_OFFSET)
    B = ctx.cfg.env.tasks_per_step
    trajs, t0 = [], time.perf_counter()
    tasks = ctx.source.at_step(ctx.eval_tasks, step)
    for i in range(0, len(tasks), B):  # split across hosts, every trajectory gathered everywhere
        trajs += ctx.rollout_split(params, tasks[i:i + B], jax.random.fold_in(key, i), greedy,
                                   gather=True)[0]
    stats = behaviour_stats(trajs)
    out = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    out["reward_mean"] = float(np.mean([t.reward for t in trajs]))
    out["eval_tasks"] = len(trajs)
    out["per_task"] = per_task_outcomes(ctx.source, trajs)
    arg_probs = oracle_argument_probs(ctx, params, tasks)
    if arg_probs is not None:  # the arms' primary metric on hidden-rule families
        out["per_task"][ORACLE_ARG] = arg_probs
        out[ORACLE_ARG] = float(np.mean(arg_probs))
    if getattr(ctx, "no_tool_baseline", None) is None:  # the same for every evaluation of a run
        ctx.no_tool_baseline = no_tool_baseline(ctx.source.make_env, ctx.eval_tasks)
    out["no_tool_baseline"] = ctx.no_tool_baseline
    out["eval_seconds"] = time.perf_counter() - t0
    return out


def per_task_outcomes(source, trajs) -> dict[str, list]:
    """Each evaluated task's id, cluster key (:meth:`lopd_jax.envs.base.TaskSource.cluster_key`)
    and reward, in evaluation order: what a paired bootstrap between runs resamples."""
    return {"task_id": [t.task.task_id for t in trajs], "cluster": [source.cluster_key(t.task) for t in trajs],
            "reward": [float(t.reward) for t in trajs]}


def put_batch(system, batch: dict) -> dict:
    """This process's rows of a batch (numpy) -> global arrays on the system's batch shardings.

    ``jax.make_array_from_process_local_data``: on one process the rows are the whole
    batch; on a pod each process passes the rows it owns (see the module docstring).
    """
    if not isinstance(batch, dict):  # a length-bucketed batch (train.bucketed_steps) puts its passes
        return batch.put(system)
    shardings = system.batch_shardings(batch)
    if shardings is None:
        return batch
    return {k: global_array(v, shardings[k]) for k, v in batch.items()}


PROGRESS_FIELDS = {"policy_version": "version", "staleness_mean": "stale", "sampler_wait_seconds": "sampler_wait_s",
                   "trainer_wait_seconds": "trainer_wait_s"}  # record key -> its name on the progress bar


def progress_fields(metrics: dict) -> dict:
    """What the progress bar shows beside a step: the policy version, the batch's mean
    staleness and (async rollouts) each side's wait, where the record has them."""
    return {short: metrics[k] for k, short in PROGRESS_FIELDS.items() if k in metrics}


def run_steps(ctx: RunContext, stage: str, state, num_steps: int, step_fn: Callable, batch_fn: Callable,
              *, shardings=None, extra_meta: Callable[[int], dict] | None = None, writer=None,
              on_metrics: Callable[[int, dict], dict] | None = None,
              on_restore: Callable[[Any, dict], None] | None = None,
              prefetch: Callable[[int], bool] | None = None):
    """Resumable step loop of one stage; returns ``(state, preempted)``.

    ``state`` is the stage's initial state (also the restore target); ``batch_fn(step)``
    gives the batch of a step (a function of the step alone, for exact resume);
    ``step_fn(state, batch) -> (state, metrics)``; ``on_metrics(step, metrics)`` may add
    to the logged record; ``on_restore(state, metadata)`` sees a restored checkpoint.
    ``prefetch(step)``: True when step + 1's batch may be built while step's update runs
    on the device (after its dispatch, before its metrics are read): the host work overlaps
    the device's, the batches are the same. The record's ``batch_seconds`` is its batch's
    building wherever it ran; ``train_seconds`` the update's dispatch and the wait for its
    metrics, less the prefetch.
    """
    c = ctx.cfg.checkpoint
    ckpt = Checkpointer(ctx.ckpt_dir(stage), every_steps=c.every_steps, keep=c.keep, async_save=c.async_save)
    try:  # closed on every exit (an error, Ctrl-C): Orbax's threads must stop before the interpreter
        start, latest = 0, None
        found = restore_newest(ckpt, state, shardings)
        if found is not None:
            state, restored_meta, latest = found
            if on_restore is not None:
                on_restore(state, restored_meta)
            start = latest
            log(f"{stage}: resumed from step {start}")
        preempted = False
        meta = lambda s: {"stage": stage, "step": s, **(extra_meta(s) if extra_meta else {})}  # noqa: E731
        guard = NonFiniteTracker(ctx.cfg.steps.max_nonfinite_skips, stage)
        ahead = None  # (step + 1's batch, its seconds) built while step ran on the device
        with Progress(num_steps, stage, initial=start) as bar:
            for s in range(start, num_steps):
                with first_step_pulse(stage, s == start):
                    t0 = time.perf_counter()
                    batch, batch_s = ahead if ahead is not None else (put_batch(ctx.system, batch_fn(s)), None)
                    t1 = time.perf_counter()
                    state, metrics = step_fn(state, batch)
                    t_ahead = time.perf_counter()
                    ahead = None
                    if prefetch is not None and s + 1 < num_steps and prefetch(s):
                        next_batch = put_batch(ctx.system, batch_fn(s + 1))
                        ahead = (next_batch, time.perf_counter() - t_ahead)
                    t_wait = time.perf_counter()
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
                    t2 = time.perf_counter()
                metrics["batch_seconds"] = t1 - t0 if batch_s is None else batch_s
                metrics["train_seconds"] = (t_ahead - t1) + (t2 - t_wait)
                if "nonfinite" in metrics:  # skipped updates; stops after steps.max_nonfinite_skips in a row
                    metrics["skipped_steps"] = float(guard.update(metrics, s + 1))
                if on_metrics is not None:
                    metrics.update(on_metrics(s, metrics))
                if writer is not None:
                    writer.write(s + 1, stage, metrics)
                bar.update(1, **progress_fields(metrics))
                done = s + 1
                if ckpt.save(done, state, meta(done), force=done == num_steps) and writer is not None:
                    writer.flush()  # a gs:// metrics object then holds every checkpointed step's record
                if done < num_steps and preemption_agreed():
                    ckpt.save(done, state, meta(done), force=True)
                    preempted = True
                    log(f"{stage}: preempted at step {done}; checkpoint saved -- rerun the same command to resume")
                    break
        if latest is not None and latest >= num_steps:
            log(f"{stage}: all {num_steps} steps already done")
    finally:
        ckpt.close()
    return state, preempted
