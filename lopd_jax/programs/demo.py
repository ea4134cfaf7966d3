"""The demo (``make demo``): LOPD learning on the CPU miniature, from a shipped starting point.

    python -m lopd_jax.demo [--workdir=workdirs/demo] [--seeds=0,1,2] [--parallel=3] [key=value ...]

The miniature's first stages (warm-up theta0, experience bank, composer cold start) are slow on
a CPU and seed-dependent, so the repository ships their output (:data:`START_DIR`, made with
``--pack=W``). The demo copies it into ``<workdir>/start``, measures the premise rows there
(``python -m lopd_jax.premise``) and runs LOPD from it once per seed, then prints the held-out
reward before and after per seed and the mean gain with its 95% cluster-level t interval
(:mod:`lopd_jax.programs.arm_stats`) and what that shows, and writes ``demo.json`` and ``demo.png``. Dotted overrides
go to every LOPD run. Details: ``docs/miniature.md``, ``docs/results.md``.

Exit status: 0 done, 1 a run failed (its log is named), 2 a bad argument or no starting point.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from configs import load_config  # noqa: E402
from lopd_jax.io.paths import REPO_ROOT  # noqa: E402
from lopd_jax.io.progress import Heartbeat, eta, format_seconds, run_position  # noqa: E402
from lopd_jax.method import statistics  # noqa: E402
from lopd_jax.programs.arm_stats import cluster_name, contrast, ledger_outcomes, run_outcomes, verdict  # noqa: E402
from lopd_jax.io.startup import configure_platform  # noqa: E402
from lopd_jax.programs.launcher import USER_ERROR_EXITS, check_workdir  # noqa: E402
from lopd_jax.settings.overrides import apply_overrides  # noqa: E402

START_DIR = os.path.join(REPO_ROOT, "data", "demo", "start")
START_FILE = "start.json"  # in START_DIR: the config and overrides that made it
PREFIX_STAGES = ("warmup", "eval_before", "bank", "cold_start")
# What a starting point keeps of a run directory (checkpoints: the newest step of each prefix stage)
KEEP_FILES = ("config.json", "stages.json", "metrics.jsonl", "premise.json")
DEMO_STEPS = 16  # configs/miniature.py's LOPD steps; the demo evaluates halfway and at the end
POLL_S = 2.0  # how often the demo looks at its runs (it prints a line every progress.INTERVAL_S)
RESULT_FILE, PLOT_FILE = "demo.json", "demo.png"


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="workdirs/demo", help="where the runs go (default workdirs/demo)")
    p.add_argument("--seeds", default="0,1,2", help="LOPD seeds, comma-separated (default 0,1,2)")
    p.add_argument("--parallel", type=int, default=3, help="processes at once (default 3: the seeds beside the "
                                                            "premise check)")
    p.add_argument("--start", default=START_DIR, help="the starting point (default: the shipped one)")
    p.add_argument("--pack", metavar="RUN_DIR", default=None,
                   help="instead of the demo: copy RUN_DIR's first stages (a run past its cold start, e.g. made "
                        "by python -m lopd_jax.premise --config=miniature) into --start")
    p.add_argument("--config", default="miniature", help="with --pack: the config RUN_DIR was made with")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for the LOPD runs; with --pack: the "
                                                "overrides RUN_DIR was made with (its seed is added)")
    return p


# ----------------------------------------------------------------------------- starting point


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def _newest_step(stage_dir: str) -> str:
    steps = [d for d in os.listdir(stage_dir) if d.isdigit()]
    if not steps:
        raise ValueError(f"{stage_dir} holds no finished checkpoint")
    return max(steps, key=int)


def pack(run_dir: str, dst: str, config: str, overrides: Sequence[str]) -> None:
    """Copy the first stages of ``run_dir`` (warm-up, evaluation before, bank, cold start) into
    ``dst``: config, ledger and metrics of those stages, the newest checkpoint of each, the
    bank and ``premise.json``; ``dst/start.json`` records ``config`` and ``overrides``."""
    ledger = _read_json(os.path.join(run_dir, "stages.json"))
    missing = [s for s in PREFIX_STAGES if not ledger.get(s, {}).get("done")]
    if missing:
        raise ValueError(f"{run_dir} has not finished {missing}; run python -m lopd_jax.premise --config=... there")
    tmp = dst.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in KEEP_FILES:
        if os.path.exists(os.path.join(run_dir, name)):
            shutil.copy(os.path.join(run_dir, name), tmp)
    for stage in ("warmup", "cold_start"):
        src = os.path.join(run_dir, "checkpoints", stage)
        step = _newest_step(src)
        shutil.copytree(os.path.join(src, step), os.path.join(tmp, "checkpoints", stage, step))
    shutil.copytree(ledger["bank"]["path"], os.path.join(tmp, "bank"))
    ledger = {k: v for k, v in ledger.items() if k in PREFIX_STAGES}
    ledger["bank"]["path"] = "bank"  # relative: unpack() points it at the copy
    _write_json(os.path.join(tmp, "stages.json"), ledger)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [ln for ln in f if ln.strip() and json.loads(ln).get("stage") in PREFIX_STAGES]
    with open(os.path.join(tmp, "metrics.jsonl"), "w") as f:
        f.writelines(rows)
    _write_json(os.path.join(tmp, START_FILE), {"config": config, "overrides": list(overrides)})
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def start_args(start: str) -> tuple[str, list[str]]:
    """``(config name, overrides)`` that made the starting point ``start``."""
    path = os.path.join(start, START_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{start} is not a demo starting point (no {START_FILE}); make one with "
                         f"python -m lopd_jax.demo --pack=RUN_DIR")
    s = _read_json(path)
    return s["config"], list(s["overrides"])


def unpack(start: str, dst: str) -> None:
    """Copy the starting point into ``dst`` as a run directory past its cold start (its
    ledger's bank path made absolute; the rest resolves against the workdir)."""
    tmp = dst.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(start, tmp, ignore=shutil.ignore_patterns(START_FILE))
    ledger = _read_json(os.path.join(tmp, "stages.json"))
    ledger["bank"]["path"] = os.path.join(os.path.abspath(dst), "bank")
    _write_json(os.path.join(tmp, "stages.json"), ledger)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


# ----------------------------------------------------------------------------- arguments


def parse_seeds(text: str) -> list[int]:
    """``--seeds``' integers; ValueError naming the flag and the fix."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds={text!r}: expected comma-separated integers, e.g. --seeds=0,1,2") from None
    if not seeds:
        raise ValueError("--seeds names no seed; e.g. --seeds=0,1,2")
    return seeds


def check_args(args: argparse.Namespace) -> tuple[list[int], str, int]:
    """``(seeds, config name, LOPD steps per run)`` of the demo's arguments, checked before
    anything is written or started; ValueError (ConfigError) naming the flag or key and the fix:
    the seeds, ``--parallel``, ``--workdir``, the starting point and the overrides (applied to
    the starting point's config as each run applies them)."""
    seeds = parse_seeds(args.seeds)
    if args.parallel < 1:
        raise ValueError(f"--parallel={args.parallel}: run at least one process at a time, e.g. --parallel=1")
    check_workdir(args.workdir)
    config, overrides = start_args(args.start)
    cmd = train_command(args.workdir, config, overrides, seeds[0], args.overrides)
    cfg = apply_overrides(load_config(config), [a for a in cmd[3:] if not a.startswith("--")])
    return seeds, config, cfg.stages.lopd_steps


# ----------------------------------------------------------------------------- runs


def train_command(workdir: str, config: str, overrides: Sequence[str], seed: int, extra: Sequence[str]) -> list[str]:
    """The LOPD run of one seed from a copy of the starting point (its seed allowed to differ)."""
    kept = [o for o in overrides if not o.startswith("seed=")]
    return [sys.executable, "-m", "lopd_jax.train", f"--config={config}", f"--workdir={workdir}", *kept,
            f"seed={seed}", f"stages.eval_every={DEMO_STEPS // 2}", *extra, "--allow_config_change=seed"]


def _run(cmd: list[str], log: str) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.getcwd()).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {rc}; see {log}")
    return time.perf_counter() - t0


def progress_line(workdir: str, jobs: dict, steps: int, elapsed: float) -> str:
    """One line on the runs: each one's state (queued, its stage and step, done, failed), the
    LOPD steps done of all and the ETA at that pace."""
    parts, done = [], 0
    for name, job in jobs.items():
        if name == "premise":
            parts.append("premise " + ("done" if job.done() else "running" if job.running() else "queued"))
            continue
        stage, step = run_position(os.path.join(workdir, f"seed{name}"), PREFIX_STAGES)
        lopd = steps if job.done() else step if stage == "lopd" else 0
        done += lopd
        state = ("failed" if job.exception() else "done") if job.done() else (
            "queued" if not job.running() else f"{stage} step {step}" if stage else "starting")
        parts.append(f"seed{name} {state}")
    total = steps * (len(jobs) - 1)
    return (f"[demo {format_seconds(elapsed)}] " + ", ".join(parts) +
            f"; LOPD steps {done}/{total}, ETA {eta(done, total, elapsed)}")


def wait_with_progress(workdir: str, jobs: dict, steps: int, beat: Heartbeat | None = None,
                       poll_s: float = POLL_S) -> None:
    """Wait for every job, printing :func:`progress_line` whenever ``beat`` is due (every 30 s)."""
    beat, t0 = beat or Heartbeat(), time.monotonic()
    while True:
        _, pending = concurrent.futures.wait(jobs.values(), timeout=poll_s)
        if not pending:
            return
        if beat.due():
            print(progress_line(workdir, jobs, steps, time.monotonic() - t0), flush=True)


def held_out_curve(run_dir: str) -> list[tuple[int, float]]:
    """``(LOPD step, held-out reward)`` of a run: before, the intermediate evaluations, after."""
    pts = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for ln in f:
            r = json.loads(ln) if ln.strip() else {}
            if r.get("stage") in ("eval_before", "eval", "eval_after"):
                pts[int(r["step"])] = float(r["reward_mean"])
    return sorted(pts.items())


def before_outcomes(run_dir: str, premise: dict) -> dict[str, list] | None:
    """The per-task held-out outcomes before LOPD: the run's evaluation before when it kept
    them, else the premise check's ``base`` row (theta0, greedy, the same tasks and key)."""
    return run_outcomes(run_dir, "eval_before") or premise.get("rows", {}).get("base", {}).get("per_task")


def gain_interval(runs: dict[int, dict]) -> dict[str, Any] | None:
    """After - before with its cluster-level t interval over the tasks' cluster keys
    (customer), the seeds averaged within each cluster (:func:`arm_stats.contrast`); None when
    a run lacks per-task outcomes."""
    rs = list(runs.values())
    if any(r.get("after_tasks") is None for r in rs) or rs[0].get("before_tasks") is None:
        return None
    c = contrast([r["after_tasks"] for r in rs], [rs[0]["before_tasks"]])
    c["cluster_name"] = cluster_name([rs[0]["after_tasks"]])
    return c


def summarize(premise: dict, runs: dict[int, dict]) -> dict[str, Any]:
    """The demo's numbers: before, after per seed, mean, sample SD, range, gain and its
    interval (:func:`gain_interval`)."""
    before = next(iter(runs.values()))["before"]
    after = np.array([r["after"] for r in runs.values()])
    spread = float(after.max() - after.min())
    gain = float(after.mean() - before)
    return {"before": before, "after_mean": float(after.mean()), "after_sd": statistics.sample_sd(after),
            "after_range": spread, "gain": gain, "gain_interval": gain_interval(runs),
            "no_tool_baseline": premise.get("no_tool_baseline"), "premise": premise.get("rows", {}),
            "runs": {str(k): {n: v for n, v in r.items() if not n.endswith("_tasks")} for k, r in runs.items()}}


def gain_line(s: dict[str, Any]) -> str:
    """The verdict: the gain with its interval, or why there is none."""
    c = s["gain_interval"]
    if c is None:
        return (f"gain {s['gain']:+.4f} (no interval: the runs kept no per-task outcomes; rerun them with this "
                f"version)")
    line = (f"gain {statistics.format_interval(c)} ({statistics.describe_design(c, c['cluster_name'])}); "
            f"{verdict(c)}")
    if not c["seed_spread"]:
        line += "; a seed-to-seed interval needs >= 2 seeds"
    return line


def shows_line(s: dict[str, Any]) -> str:
    """What the demo shows, and what it does not."""
    n = len(s["runs"])
    return (f"what this shows: the held-out reward of LOPD runs from one shipped start (theta0, bank, composer) "
            f"against that start, over {n} seed{'s' if n > 1 else ''}; it compares no other arm (LOPD against the "
            f"frozen composer, m = 0 or GRPO: python -m benchmarks.rank_arms) and no other start")


def report(s: dict[str, Any]) -> str:
    """The printed summary."""
    lines = ["premise (held-out, greedy; before any LOPD step):",
             "| row | reward | success | tool calls | errors |", "|---|---|---|---|---|"]
    for name, r in s["premise"].items():
        lines.append(f"| {name} | {r['reward']:.4f} | {r['success_rate']:.1%} | {r['tool_calls']:.2f} | "
                     f"{r['errors']:.2f} |")
    lines.append(f"no-tool baseline (answer at once, no tool call): {s['no_tool_baseline']:.4f}")
    steps = sorted({st for r in s["runs"].values() for st, _ in r["curve"]})
    lines += ["", "LOPD, held-out reward by training step (64 tasks, greedy):",
              "| seed | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---|" * len(steps)]
    for k, r in s["runs"].items():
        curve = dict(r["curve"])
        lines.append(f"| {k} | " + " | ".join(f"{curve[st]:.4f}" if st in curve else "-" for st in steps) + " |")
    n = len(s["runs"])
    spread = (f" ± {s['after_sd']:.4f} (mean ± sample SD over {n} seeds, range {s['after_range']:.4f})" if n > 1
              else " (one seed)")
    lines += ["", f"held-out reward before LOPD: {s['before']:.4f}; after: {s['after_mean']:.4f}{spread}",
              gain_line(s), shows_line(s)]
    return "\n".join(lines)


def plot(s: dict[str, Any], path: str) -> str:
    """Held-out reward against LOPD steps, one line per seed, the premise rows as references."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, r in s["runs"].items():
        x, y = zip(*r["curve"])
        ax.plot(x, y, marker="o", lw=1.8, label=f"LOPD, seed {k}")
    refs = (("base + oracle text", "tab:green"), ("base + composer", "tab:purple"), ("base", "gray"))
    for name, color in refs:
        if name in s["premise"]:
            ax.axhline(s["premise"][name]["reward"], color=color, ls="--", lw=1, label=f"θ0: {name}")
    ax.axhline(s["no_tool_baseline"], color="black", ls=":", lw=1, label="no-tool baseline")
    ax.set_xlabel("LOPD step (8 rollouts each)")
    ax.set_ylabel("held-out reward (64 tasks, greedy)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"LOPD on the CPU miniature: {s['before']:.3f} → {s['after_mean']:.3f} (gain {s['gain']:+.3f})")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", fontsize=8)  # the curves start low and end on the right
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(workdir: str, start: str, seeds: Sequence[int], parallel: int, extra: Sequence[str],
             steps: int = DEMO_STEPS) -> dict[str, Any]:
    """Unpack, run the premise check and the seeds (``steps`` LOPD steps each: the progress
    lines' total), and collect :func:`summarize`'s numbers."""
    config, overrides = start_args(start)
    prefix = os.path.join(workdir, "start")
    os.makedirs(workdir, exist_ok=True)
    unpack(start, prefix)  # read-only there; premise.json is measured anew
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        premise_log = os.path.join(workdir, "premise.log")
        jobs["premise"] = pool.submit(_run, [sys.executable, "-m", "lopd_jax.premise", f"--workdir={prefix}"],
                                      premise_log)
        for k in seeds:
            run_dir = os.path.join(workdir, f"seed{k}")
            unpack(start, run_dir)  # a fresh copy: the demo always reruns its LOPD stage
            jobs[k] = pool.submit(_run, train_command(run_dir, config, overrides, k, extra), run_dir + ".log")
        wait_with_progress(workdir, jobs, steps)
        failed = [str(job.exception()) for job in jobs.values() if job.exception()]
        if failed:
            raise RuntimeError("\n".join(failed))
        walls = {name: job.result() for name, job in jobs.items()}
    premise = _read_json(os.path.join(prefix, "premise.json"))
    runs = {}
    for k in seeds:
        run_dir = os.path.join(workdir, f"seed{k}")
        led = _read_json(os.path.join(run_dir, "stages.json"))
        runs[k] = {"before": led["eval_before"]["reward_mean"], "after": led["eval_after"]["reward_mean"],
                   "curve": held_out_curve(run_dir), "train_stage_seconds": led["lopd"]["seconds"],
                   "wall_seconds": round(walls[k], 1), "after_tasks": ledger_outcomes(led, "eval_after"),
                   "before_tasks": before_outcomes(run_dir, premise)}
    s = summarize(premise, runs)
    s.update(start=os.path.abspath(start), config=config, start_overrides=overrides, extra_overrides=list(extra),
             premise_seconds=round(walls["premise"], 1))
    return s


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    configure_platform()  # the train / premise processes it starts inherit the platform choice
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.pack:
            config_json = _read_json(os.path.join(args.pack, "config.json"))
            pack(args.pack, args.start, args.config, [f"seed={config_json['seed']}", *args.overrides])
            print(f"starting point written to {args.start}")
            return 0
        seeds, config, steps = check_args(args)  # before anything is written or started
        print(f"LOPD demo: configs/{config}.py from {os.path.relpath(args.start)} (theta0, bank, phi0); "
              f"{len(seeds)} LOPD runs (seeds {args.seeds}) and the premise check, {args.parallel} at a time; "
              f"logs under {args.workdir}; a progress line every 30 s", flush=True)
        s = run_demo(args.workdir, args.start, seeds, args.parallel, args.overrides, steps)
    except tuple(USER_ERROR_EXITS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    s["wall_seconds"] = round(time.perf_counter() - t0, 1)
    _write_json(os.path.join(args.workdir, RESULT_FILE), s)
    print(report(s))
    print(f"plot: {plot(s, os.path.join(args.workdir, PLOT_FILE))}\n"
          f"numbers: {os.path.join(args.workdir, RESULT_FILE)}; wall {s['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
