"""RL steps per hour: asynchronous rollouts (``rollout.mode=async``, k = 1) against sync (CPU).

The LOPD training stage of ``--config`` (default the miniature's environment and caps, with
the random-init tiny model: no warm-up, composer phi0, a bank of the run's own rollouts)
runs ``--steps`` steps of the same rollouts per step in sync and in async at
``--max_staleness``, in one process and one run context, sharing one jitted update: an untimed first run of
each mode, as long as a timed one, compiles the update and the sampler's shapes, then
``--rounds`` timed rounds alternate between the modes (each a fresh workdir, checkpoints at
the end only). ``--partial``: the async side runs one engine across the steps (partial
rollouts, ``rollout.partial``). Steps per hour are over the whole stage (first rollout to last
update); the ratio is of the medians. The rollouts' share of a sync step is printed: it
bounds what overlapping them can save. Both sides share the host's cores: the overlap helps
only where rollouts and updates do not both saturate them.

    python -m benchmarks.bench_rl_step
    python -m benchmarks.bench_rl_step --steps 4 --rounds 3
    python -m benchmarks.bench_rl_step --partial
    python -m benchmarks.bench_rl_step --partial --batch_order finished

Methodology and measurements: ``docs/rl_step.md``, ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cached_step_stage():
    """:class:`train.training_stage.ArmStage` (the run's arm) whose jitted update is built once and shared by
    every stage of the run (each stage would otherwise compile its own)."""
    from train.training_stage import ArmStage

    class CachedStepStage(ArmStage):
        cache: dict = {}

        def make_step(self, state, batch):
            if "step" not in self.cache:
                self.cache["step"] = super().make_step(state, batch)
            return self.cache["step"]
    return CachedStepStage


def run_stage(ctx, base, bank, bank_path, composer0, workdir: str, mode: str, k: int, steps: int,
              stage_cls=None, partial: bool = False, batch_order: str = "step"):
    """One LOPD stage of ``steps`` steps in ``workdir``; ``(seconds, its records)``."""
    from train.metrics import MetricsWriter, read_metrics
    from train.training_stage import ArmStage
    stage_cls = stage_cls or ArmStage
    on = partial and mode == "async"
    rollout = dataclasses.replace(base.rollout, mode=mode, max_staleness=k, partial=on,
                                  batch_order=batch_order if on else "step")
    ctx.cfg = dataclasses.replace(base, workdir=workdir, rollout=rollout,
                                  stages=dataclasses.replace(base.stages, lopd_steps=steps))
    writer = MetricsWriter(workdir, console=False, tensorboard=False)
    try:
        stage = stage_cls(ctx, bank, bank_path, composer0, writer)
        t0 = time.perf_counter()
        _, preempted = stage.run()
        seconds = time.perf_counter() - t0
    finally:
        writer.close()
        ctx.cfg = base
    if preempted:
        raise RuntimeError("the stage was preempted")
    return seconds, read_metrics(os.path.join(workdir, "metrics.jsonl"), "lopd")


def main(argv=None):
    """Run the benchmark; the last line is the ratio."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="miniature")
    p.add_argument("--steps", type=int, default=4, help="training steps per timed run")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each mode (alternating)")
    p.add_argument("--max_staleness", type=int, default=1, help="k of the async side")
    p.add_argument("--partial", action="store_true", help="the async side runs partial rollouts (rollout.partial)")
    p.add_argument("--batch_order", default="step", choices=("step", "finished"),
                   help="--partial: rollout.batch_order of the async side")
    p.add_argument("--override", action="append", default=[], help="extra dotted.key=value settings")
    args = p.parse_args(argv)

    from configs import load_config
    from lopd_jax.settings.overrides import apply_overrides
    from train.bank_stage import build_bank
    from train.run_context import RunContext

    root = tempfile.mkdtemp(prefix="bench_rl_step-")
    cfg = apply_overrides(load_config(args.config), [
        "stages.warmup_steps=0", "stages.eval_every=0", "bank.min_reward=0.0", "checkpoint.every_steps=100000",
        "checkpoint.async_save=false", f"workdir={root}/base", *args.override])
    ctx = RunContext(cfg)
    frozen, lora0, comp0 = ctx.system.initial_params()
    bank, info = build_bank(ctx, {**frozen, **lora0}, root)
    composer0 = {"lora": lora0, "compressor": comp0}
    print(f"config {args.config}: {cfg.env.tasks_per_step * cfg.env.group_size} rollouts per step, {args.steps} "
          f"steps per run, bank of {len(bank)}, load average {os.getloadavg()[0]:.1f}", flush=True)

    modes = [("sync", 0), ("async", args.max_staleness)]
    stage_cls = cached_step_stage()
    for mode, k in modes:  # compiles (sampler, step) outside the timed runs
        s, _ = run_stage(ctx, cfg, bank, info["path"], composer0, f"{root}/warm-{mode}", mode, k, args.steps,
                         stage_cls, args.partial, args.batch_order)
        print(f"warm-up {mode}: {s:.1f} s (compiles included)", flush=True)
    times: dict[str, list[float]] = {"sync": [], "async": []}
    stale: list[float] = []
    partial: list[float] = []
    restarted: list[float] = []
    share: list[float] = []
    for r in range(args.rounds):
        for mode, k in modes if r % 2 == 0 else modes[::-1]:
            s, recs = run_stage(ctx, cfg, bank, info["path"], composer0, f"{root}/{mode}-{r}", mode, k, args.steps,
                                stage_cls, args.partial, args.batch_order)
            times[mode].append(s)
            roll = sum(x["rollout_seconds"] for x in recs)
            train = sum(x["train_seconds"] for x in recs)
            line = f"round {r} {mode:5s}: {s:7.1f} s, {3600 * args.steps / s:7.1f} steps/h, rollouts {roll:.1f} s, " \
                   f"updates {train:.1f} s"
            if mode == "sync":
                share.append(roll / s)
            else:
                stale += [x["staleness_mean"] for x in recs]
                partial += [x.get("partial_rollouts", 0) for x in recs]
                restarted += [x.get("rollouts_restarted", 0) for x in recs]
                line += (f", trainer waited {sum(x['trainer_wait_seconds'] for x in recs):.1f} s, sampler waited "
                         f"{sum(x['sampler_wait_seconds'] for x in recs):.1f} s")
            print(line + f", load {os.getloadavg()[0]:.1f}", flush=True)
    sync_s, async_s = statistics.median(times["sync"]), statistics.median(times["async"])
    print(f"median stage time: sync {sync_s:.1f} s, async {async_s:.1f} s ({args.steps} steps, "
          f"{args.rounds} rounds each); rollouts are {100 * statistics.median(share):.0f}% of a sync stage")
    if args.partial:
        print(f"partial rollouts: {sum(partial):.0f} of {args.rounds * args.steps * cfg.env.tasks_per_step * cfg.env.group_size}"
              f" async rollouts went on under a newer student; {sum(restarted):.0f} restarted (batch order "
              f"{args.batch_order})")
    print(f"rl step: async/sync steps per hour = {sync_s / async_s:.2f}x (staleness mean {statistics.mean(stale):.2f})")


if __name__ == "__main__":
    main()
