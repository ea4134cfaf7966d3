"""The miniature's core comparison: arms x seeds forked from one shared prefix, or from several.

    python -m benchmarks.miniature_core --config=miniature --workdir=W \\
        [--arms=lopd,grpo,lopd_frozen_composer,m0] [--seeds=0,1,2] [--prefix_seeds=0,1,2] [--parallel=2]
        [key=value ...]

Runs the shared stages (warm-up, evaluation before, bank, cold start) once in ``W/prefix``, as
the paper's seeds all start from one checkpoint; then each arm x seed resumes a copy of it in
``W/runs/ARM_sSEED`` (training stage, evaluation after, export; finished runs are skipped).
With ``--prefix_seeds=a,b,c`` each prefix ``W/prefix_P`` is built with ``seed=P`` (its own
theta0, bank and phi0) and every arm x seed is forked from each, in ``W/runs/ARM_pP_sSEED``;
the records carry ``prefix`` and the contrasts pair runs within each prefix
(:func:`lopd_jax.programs.arm_stats.prefix_means`).
The runs share JAX's persistent compilation cache (``W/jax_cache``; ``--compile_cache``), so
only the first run of each program compiles it. ``W/results.json`` holds one record per run;
the table (mean +- sample SD over seeds) is printed with :mod:`benchmarks.rank_arms`'s
contrasts and ranking. Arms: ``lopd``, ``grpo``,
``lopd_frozen_composer``, ``m0`` (``steps.margin=0``), any other ``TrainConfig.arm``, and
``ARM_asyncK`` (ARM with ``rollout.mode=async rollout.max_staleness=K``) and ``ARM_partialK``
(the same with partial rollouts in finished order: ``rollout.partial=true
rollout.batch_order=finished``). Details:
``docs/miniature.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import time

import numpy as np

from benchmarks import rank_arms
from configs import load_config
from lopd_jax.io.progress import describe_run, run_and_follow
from lopd_jax.method.statistics import sample_sd
from lopd_jax.settings.arm_config import ARMS
from lopd_jax.settings.overrides import apply_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARM_OVERRIDES = {"lopd": [], "m0": ["steps.margin=0"]}
TRAINING_STAGES = ("lopd", "eval_after", "export")
WALL_FILE = "wall.json"
ASYNC_ARM = rank_arms.ASYNC_ARM


def async_grid(k: str, mode: str = "async") -> tuple[tuple[str, str], ...]:
    """The overrides (key, value) of asynchronous rollouts at staleness ``k`` (``mode``
    ``partial``: partial rollouts in finished order)."""
    grid = (("rollout.mode", "async"), ("rollout.max_staleness", str(k)))
    if mode == "partial":
        grid += tuple(tuple(g.split("=", 1)) for g in rank_arms.PARTIAL_GRID)
    return grid


def arm_overrides(arm: str) -> list[str]:
    """Config overrides of an arm name (``ARM_asyncK``: ARM's, then async rollouts at staleness K)."""
    m = ASYNC_ARM.match(arm)
    if m:
        return [*arm_overrides(m["arm"]), *[f"{k}={v}" for k, v in async_grid(m["k"], m["mode"])]]
    return ARM_OVERRIDES.get(arm, [f"arm={arm}"])


def unknown_arms(arms: list[str]) -> list[str]:
    """The names in ``arms`` that are neither a registered arm nor ``m0`` (each may end in
    ``_asyncK`` / ``_partialK``)."""
    bases = [m["arm"] if (m := ASYNC_ARM.match(a)) else a for a in arms]
    return [a for a, b in zip(arms, bases) if b not in ARMS and b not in ARM_OVERRIDES]


def run_env(W: str, compile_cache: str = "") -> dict[str, str]:
    """The training processes' environment: JAX's persistent compilation cache in
    ``compile_cache`` (default ``W/jax_cache``, shared by the prefix and every run, so only the
    first run of a program compiles it; ``none``: no cache). A ``JAX_COMPILATION_CACHE_DIR``
    already set wins."""
    env = dict(os.environ)
    if "JAX_COMPILATION_CACHE_DIR" not in env and compile_cache != "none":
        env["JAX_COMPILATION_CACHE_DIR"] = compile_cache or os.path.join(W, "jax_cache")
    return env


def _train(workdir: str, config: str, overrides: list[str], log: str, env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    steps = apply_overrides(load_config(config), overrides).stages.lopd_steps
    code = run_and_follow([sys.executable, "-m", "lopd_jax.train", f"--config={config}", f"--workdir={workdir}",
                           *overrides], log, describe_run(workdir, f"[miniature_core] {os.path.basename(workdir)}",
                                                          steps), cwd=ROOT, env=env, file=sys.stdout)
    if code != 0:
        raise RuntimeError(f"training run in {workdir} failed (exit {code}); see {log}")
    return time.perf_counter() - t0


def _ledger(workdir: str) -> dict:
    path = os.path.join(workdir, "stages.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def fork(prefix: str, run_dir: str, config: str, overrides: list[str]) -> None:
    """Copy the prefix into ``run_dir`` without its training stage and write the run's config."""
    from lopd_jax.settings.run_config import save_run_config
    from lopd_jax.programs.train import resolve_config

    tmp = run_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(prefix, tmp, ignore=shutil.ignore_patterns("lopd", "export", "plot.png", "premise.json", "tb"))
    ledger = {k: v for k, v in _ledger(prefix).items() if k not in TRAINING_STAGES}
    with open(os.path.join(tmp, "stages.json"), "w") as f:
        json.dump(ledger, f, indent=1)
    with open(os.path.join(prefix, "metrics.jsonl")) as src, open(os.path.join(tmp, "metrics.jsonl"), "w") as dst:
        dst.writelines(line for line in src if json.loads(line).get("stage") not in TRAINING_STAGES)
    os.remove(os.path.join(tmp, "config.json"))
    cfg = resolve_config([f"--config={config}", f"--workdir={run_dir}", *overrides])
    save_run_config(cfg, tmp)  # the unresolved config, as ``python -m lopd_jax.train`` saves it
    os.replace(tmp, run_dir)


def prefix_dir(W: str, prefix: int | None) -> str:
    """The shared prefix's directory: ``W/prefix`` for a one-prefix grid, ``W/prefix_P`` for
    prefix seed P."""
    return os.path.join(W, "prefix" if prefix is None else f"prefix_{prefix}")


def run_dir_of(W: str, arm: str, seed: int, prefix: int | None = None) -> str:
    """A run's directory: ``W/runs/ARM_sSEED``, or ``W/runs/ARM_pP_sSEED`` forked from prefix P."""
    return os.path.join(W, "runs", f"{arm}_s{seed}" if prefix is None else f"{arm}_p{prefix}_s{seed}")


def record(run_dir: str, arm: str, seed: int, overrides: list[str], wall: float | None,
           prefix: int | None = None) -> dict:
    """The results record of a finished run (``wall``: seconds of its training process; None
    reads ``run_dir/wall.json``, written when this script ran it, else stays None; ``prefix``:
    its prefix seed, recorded only for a several-prefix grid)."""
    led = _ledger(run_dir)
    if wall is None and os.path.exists(os.path.join(run_dir, WALL_FILE)):
        wall = json.load(open(os.path.join(run_dir, WALL_FILE)))["wall_seconds"]
    from train.metrics import read_metrics

    train = read_metrics(os.path.join(run_dir, "metrics.jsonl"), "lopd")  # a resumed run's redone steps once
    rollouts = int(sum(r.get("rollouts", 0) for r in train))
    roll_s = float(sum(r.get("rollout_seconds", 0.0) for r in train))
    b, a = led["eval_before"], led["eval_after"]
    return {"arm": arm, "seed": seed, **({} if prefix is None else {"prefix": prefix}),
            "overrides": overrides, "rollouts": rollouts,
            "reward_before": b["reward_mean"], "reward_after": a["reward_mean"],
            "success_before": b["success_rate"], "success_after": a["success_rate"],
            "arg_prob_before": b.get("oracle_arg_prob"), "arg_prob_after": a.get("oracle_arg_prob"),
            "no_tool_baseline": b.get("no_tool_baseline"), "train_stage_seconds": led["lopd"].get("seconds"),
            "wall_seconds": wall, "rollouts_per_minute": 60.0 * rollouts / max(led["lopd"].get("seconds") or 1e-9, 1e-9),
            "rollout_only_per_minute": 60.0 * rollouts / max(roll_s, 1e-9),
            "train_reward_curve": [r.get("reward_mean") for r in train],
            "delta_curve": [r.get("delta") for r in train], "beta_curve": [r.get("beta") for r in train]}


def table(records: list[dict]) -> str:
    """Markdown table: mean +- sample SD (ddof=1; nan with one seed) over seeds per arm
    (``oracle_arg_prob``: :mod:`train.oracle_scores`, '-' where a run lacks it); seconds are means (``s / step``: the
    training stage's seconds over its steps, rollouts included; ``run wall s``: the whole
    training process of the run, evaluation after and export included)."""
    lines = ["| arm | seeds | rollouts | held-out reward before | after | success before | after | oracle_arg_prob after | "
             "train stage s | s / step | run wall s | rollouts/min |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    arms = list(dict.fromkeys(r["arm"] for r in records))
    for arm in arms:
        rs = [r for r in records if r["arm"] == arm]
        ms = lambda k: f"{np.mean([r[k] for r in rs]):.4f} ± {sample_sd([r[k] for r in rs]):.4f}"  # noqa: E731
        lines.append(f"| {arm} | {len(rs)} | {rs[0]['rollouts']} | {ms('reward_before')} | {ms('reward_after')} | "
                     f"{ms('success_before')} | {ms('success_after')} | "
                     f"{ms('arg_prob_after') if all(r.get('arg_prob_after') is not None for r in rs) else '-'} | "
                     f"{np.mean([r['train_stage_seconds'] for r in rs]):.0f} | "
                     f"{np.mean([r['train_stage_seconds'] / max(len(r['train_reward_curve']), 1) for r in rs]):.0f} | "
                     f"{_mean_or_dash([r['wall_seconds'] for r in rs])} | "
                     f"{np.mean([r['rollouts_per_minute'] for r in rs]):.1f} |")
    return "\n".join(lines)


def _mean_or_dash(values) -> str:
    known = [v for v in values if v is not None]
    return f"{np.mean(known):.0f}" if known else "-"


def sweep_report(W: str, arms: list[str], seeds: list[int]) -> list[str]:
    """The finished runs in :mod:`lopd_jax.sweep`'s layout (``W/report/runs/<name>/seed<k>``,
    symlinks; ``m0`` is ``lopd__steps.margin=0``) and its report: ``results.json``,
    ``results.md`` and the figures, under ``W/report``."""
    from lopd_jax.core.defaults import MARGIN
    from lopd_jax.programs.sweep import RunSpec
    from lopd_jax.programs.sweep_report import write_report

    margin = MARGIN  # the configs' steps.margin (the paper's 0.05)
    R, specs = os.path.join(W, "report"), []
    for seed in seeds:
        for arm in arms:
            src = os.path.join(W, "runs", f"{arm}_s{seed}")
            if not _ledger(src).get("eval_after", {}).get("done"):
                continue
            m = ASYNC_ARM.match(arm)
            base, grid = (m["arm"], async_grid(m["k"], m["mode"])) if m else (arm, ())
            if base == "m0":
                spec = RunSpec("lopd", seed, (("steps.margin", "0"), *grid), ())
            elif base == "lopd" and "m0" in arms and not grid:  # named by its margin: the report draws fig3_margin
                spec = RunSpec("lopd", seed, (("steps.margin", str(margin)),), ())
            else:
                spec = RunSpec(base, seed, grid, ())
            dst = spec.workdir(R)
            if not os.path.exists(dst):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.symlink(src, dst)
            specs.append(spec)
    return write_report(R, specs) if specs else []


def main(argv=None) -> int:
    """Run or resume the prefix and every arm x seed; write results.json; print the table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.miniature_core", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="miniature")
    p.add_argument("--workdir", required=True)
    p.add_argument("--arms", default="lopd,grpo,lopd_frozen_composer,m0")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--prefix_seeds", default="", help="several prefixes, W/prefix_P from warm-up seed P each "
                   "(default: one prefix, W/prefix, from the config's seed)")
    p.add_argument("--parallel", type=int, default=1, help="training runs at once")
    p.add_argument("--report_only", action="store_true", help="only collect finished runs and write the reports")
    p.add_argument("--compile_cache", default="", help="JAX's persistent compilation cache for the runs "
                   "(default W/jax_cache; 'none' for none; JAX_COMPILATION_CACHE_DIR, when set, wins)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if unknown_arms(args.arms.split(",")):
        p.error(f"--arms: unknown {unknown_arms(args.arms.split(','))}; choose from {', '.join([*ARMS, 'm0'])}, "
                "each optionally with _asyncK or _partialK")
    from lopd_jax.io.startup import configure_platform

    configure_platform()  # before JAX is imported (here and in the runs it starts): no libtpu noise on CPU
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    prefixes = [int(p) for p in args.prefix_seeds.split(",")] if args.prefix_seeds else [None]
    W = os.path.abspath(args.workdir)
    os.makedirs(os.path.join(W, "runs"), exist_ok=True)
    t_sweep = time.perf_counter()
    jobs = [(a, s, p) for p in prefixes for s in seeds for a in arms]
    if args.report_only:
        records = [record(run_dir_of(W, a, s, p), a, s, [*args.overrides, *arm_overrides(a), f"seed={s}"], None, p)
                   for a, s, p in jobs if _ledger(run_dir_of(W, a, s, p)).get("eval_after", {}).get("done")]
        with open(os.path.join(W, "results.json"), "w") as f:
            json.dump({"config": args.config, "overrides": args.overrides, "prefix_seeds": prefixes,
                       "records": records}, f, indent=1)
        print(table(records))
        print(rank_arms.format_report(rank_arms.report(W)))
        if prefixes == [None]:  # lopd_jax.sweep's layout has no prefix
            print("\n".join(sweep_report(W, arms, seeds)))
        return 0
    env = run_env(W, args.compile_cache)
    for p in prefixes:  # the prefix stages' seed is the prefix seed: theta0, bank and phi0 are its draw
        if not _ledger(prefix_dir(W, p)).get("cold_start", {}).get("done"):
            log = os.path.join(W, "prefix.log" if p is None else f"prefix_{p}.log")
            _train(prefix_dir(W, p), args.config,
                   [*args.overrides, *([] if p is None else [f"seed={p}"]), "stages.lopd_steps=0"], log, env)

    def one(job):
        arm, seed, prefix = job
        run_dir = run_dir_of(W, arm, seed, prefix)
        overrides = [*args.overrides, *arm_overrides(arm), f"seed={seed}"]
        wall = None
        if not _ledger(run_dir).get("eval_after", {}).get("done"):
            if not os.path.isdir(run_dir):
                fork(prefix_dir(W, prefix), run_dir, args.config, overrides)
            wall = _train(run_dir, args.config, overrides, run_dir + ".log", env)
            with open(os.path.join(run_dir, WALL_FILE), "w") as f:
                json.dump({"wall_seconds": wall}, f)
            print(f"finished {os.path.basename(run_dir)} in {wall:.0f}s", flush=True)
        return record(run_dir, arm, seed, overrides, wall, prefix)

    def safe(job):  # one failed run must not cancel the others (pool.map cancels what is pending)
        try:
            return one(job)
        except Exception as e:  # noqa: BLE001 -- reported below, exit status 1
            print(f"FAILED {os.path.basename(run_dir_of(W, *job))}: {e}", flush=True)
            return None

    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
        results = list(pool.map(safe, jobs))
    records = [r for r in results if r is not None]
    out = {"config": args.config, "overrides": args.overrides, "prefix_seeds": prefixes,
           "sweep_seconds": time.perf_counter() - t_sweep, "records": records}
    with open(os.path.join(W, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(table(records))
    print(rank_arms.format_report(rank_arms.report(W)))
    print(f"sweep wall time this invocation: {out['sweep_seconds']:.0f}s")
    return 0 if len(records) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
