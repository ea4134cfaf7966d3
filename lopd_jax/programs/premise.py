"""The premise check of self-distillation: does a privileged context help theta0 at all?

Self-distillation can only help where the teacher (theta0 with a privileged context) does
better than theta0 alone. On a run's held-out tasks this measures ``base``, ``base + oracle
text`` (:mod:`lopd_jax.envs.privileged`) and ``base + composer``
(:mod:`lopd_jax.programs.composer_eval`): reward, success, calls and errors, the gap to ``base``
with its 95% cluster-level t interval (:func:`add_gaps`) and the oracle demonstration's
log-prob per token (:func:`oracle_logprob`), beside the no-tool baseline.

    python -m lopd_jax.premise --config=miniature --workdir=W [key=value ...]
    python -m lopd_jax.premise --workdir=W        # a run that has finished its cold start

Without a finished cold start in ``W`` the run's first stages run there first. The table is
printed and written to ``W/premise.json`` (docs/miniature.md, "The premise check").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Iterable, Mapping, Sequence

import jax

from lopd_jax.envs.privileged import HintedTaskSource
from lopd_jax.io import files
from lopd_jax.method.eval_stats import behaviour_stats, no_tool_baseline
from lopd_jax.programs.arm_stats import cluster_name, contrast
from lopd_jax.programs.composer_eval import latent_context, load_composer_run
from lopd_jax.programs.train import USER_ERRORS, resolve_config, run_training
from train import warmup
from train.batches import cold_start_batch
from train.ledger import StageLedger
from lopd_jax.rollout.episodes import rollout, training_arrays
from train.stage_loop import EVAL_RNG_OFFSET, per_task_outcomes
from train.steps import cold_start_loss

ROWS = ("base", "base + oracle text", "base + composer")
RESULT_FILE = "premise.json"


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.premise", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None,
                   help="the run directory (created by --config when missing); default with --config: the "
                        "config's workdir, as for lopd_jax.train")
    p.add_argument("--config", default=None, help="run the first stages of this config in --workdir first")
    p.add_argument("--split", default="heldout", choices=("train", "heldout"))
    p.add_argument("--num_tasks", type=int, default=None, help="first N tasks of the split (default: all)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key=value (with --config)")
    return p


def _row(trajs, seconds: float, source) -> dict[str, Any]:
    s = behaviour_stats(trajs)
    return {"reward": s["mean_reward"], "success_rate": s["success_rate"], "tool_calls": s["mean_tool_calls"],
            "errors": s["mean_errors"], "episodes": len(trajs), "seconds": round(seconds, 2),
            "reward_by_family": s["reward_by_family"], "per_task": per_task_outcomes(source, trajs)}


def measure(run, tasks: Sequence) -> dict[str, dict[str, Any]]:
    """The three rows for ``tasks`` given a reopened run (:func:`lopd_jax.programs.composer_eval.load_composer_run`)."""

    ctx = run.ctx
    r = ctx.cfg.rollout
    greedy = dataclasses.replace(r.sampling, temperature=0.0)
    params, B = run.base_params(), ctx.cfg.env.tasks_per_step
    key = jax.random.fold_in(jax.random.key(ctx.cfg.seed), EVAL_RNG_OFFSET)
    hinted = HintedTaskSource(ctx.source)
    out = {}
    for name in ROWS:
        t0, trajs = time.perf_counter(), []
        for i in range(0, len(tasks), B):
            batch = tasks[i:i + B]
            make_env = hinted.make_env if name == "base + oracle text" else ctx.source.make_env
            latents = latent_context(run, batch) if name == "base + composer" else None
            trajs += rollout(ctx.engine, params, ctx.fmt, make_env, batch, jax.random.fold_in(key, i),
                             r.caps, greedy, latents=latents)
        out[name] = _row(trajs, time.perf_counter() - t0, ctx.source)
    add_gaps(out)
    return out


def add_gaps(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's reward and success gap to ``base`` and the reward gap's 95% cluster-level t
    interval over the tasks' cluster keys (``reward_gap_ci``; :func:`arm_stats.contrast`)."""
    base = rows["base"]
    for row in rows.values():
        row["reward_gap"] = row["reward"] - base["reward"]
        row["success_gap"] = row["success_rate"] - base["success_rate"]
        c = contrast([row["per_task"]], [base["per_task"]])
        row["reward_gap_ci"] = [c["lo"], c["hi"]]
        row["clusters"] = c["clusters"]


def _per_token_logprob(batch_metrics: Iterable[Mapping[str, Any]]) -> float:
    """Minus the token-weighted mean of per-batch ``nll`` (each batch's ``tokens`` its weight)."""
    total = count = 0.0
    for m in batch_metrics:
        total += float(m["nll"]) * float(m["tokens"])
        count += float(m["tokens"])
    return -total / count


def oracle_logprob(run, tasks: Sequence) -> dict[str, float]:
    """Teacher-forced: the mean log-prob per token of the oracle demonstrations' assistant
    tokens under theta0 without and with the oracle hint in the prompt, and under LOPD's
    teacher (theta0 with the cold-start composer's latents of the experiences the bank
    retrieves for each task, spliced in as the cold start and the LOPD step splice them,
    :func:`train.steps.cold_start_loss`) -- what distillation from each teacher would pull
    the student towards, independent of greedy decoding. Synthetic tasks only (the others
    have no oracle demonstrations): ``{}`` otherwise."""

    ctx = run.ctx
    _, lora0, _ = ctx.system.initial_params()
    score = jax.jit(lambda p, b: warmup.sft_loss(ctx.system, p, lora0, b)[1])
    score_latent = jax.jit(lambda c, p, b: cold_start_loss(ctx.system, c, p, b, None)[1])
    B, out = ctx.cfg.env.tasks_per_step, {}
    for name, source in (("base", None), ("base + oracle text", HintedTaskSource(ctx.source))):
        try:
            demos = warmup.demonstrations(ctx, tasks, source)
        except ValueError:
            return {}
        length, starts = -(-max(len(d) for d in demos) // 128) * 128, range(0, len(demos), B)
        arrays = (training_arrays(demos[i:i + B], length=length) for i in starts)
        out[name] = _per_token_logprob(
            score(run.frozen, {"tokens": a["tokens"], "attention_mask": a["attention_mask"], "loss_mask": a["mask"]})
            for a in arrays)
        if source is None:  # the same plain demonstrations, in the teacher-format prompt with latents
            out["base + composer"] = _per_token_logprob(
                score_latent(run.composer, run.frozen, cold_start_batch(ctx, demos[i:i + B], run.bank)) for i in starts)
    return out


def format_table(rows: dict[str, dict[str, Any]], no_tool: float) -> str:
    """The rows as a Markdown table, the no-tool baseline in the header line."""
    base = rows["base"]
    lines = [f"no-tool baseline (answer at once, no tool call): reward {no_tool:.4f}",
             "oracle-token log-prob: teacher-forced mean log-prob per token of the oracle demonstrations",
             f"reward gap interval: 95% cluster-level t over the {len(base['per_task']['task_id'])} tasks' "
             f"{cluster_name([base['per_task']])} clusters ({base.get('clusters', '?')} clusters, df = clusters - 1); "
             f"one run, so no seed spread",
             "| row | reward | success | gap to base (reward [95% CI] / success) | tool calls | errors | "
             "oracle-token log-prob |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lp = r.get("oracle_logprob")
        lo, hi = r["reward_gap_ci"]
        lines.append(f"| {name} | {r['reward']:.4f} | {r['success_rate']:.1%} | {r['reward_gap']:+.4f} "
                     f"[{lo:+.4f}, {hi:+.4f}] / {r['success_gap']:+.1%} | {r['tool_calls']:.2f} | {r['errors']:.2f} | "
                     f"{'-' if lp is None else f'{lp:.4f}'} |")
    return "\n".join(lines)


def _prepare(args) -> None:
    """Run the first stages (warm-up, bank, cold start) of ``--config`` in ``--workdir``."""

    cfg = resolve_config([f"--config={args.config}", f"--workdir={args.workdir}", *args.overrides])
    cfg = dataclasses.replace(cfg, stages=dataclasses.replace(cfg.stages, lopd_steps=0))
    if run_training(cfg) == "preempted":
        raise SystemExit("preempted before the cold start finished; rerun the same command to resume")


def _cold_start_done(workdir: str) -> bool:
    """Whether the run in ``workdir`` has finished its cold start (local runs: the ledger
    file is read without importing JAX, so a wrong path fails fast)."""
    if "://" in workdir:
        return StageLedger(workdir).done("cold_start")
    path = os.path.join(workdir, "stages.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return bool(json.load(f).get("cold_start", {}).get("done"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: prepare the run if needed, measure, print, write ``premise.json``."""

    args = build_parser().parse_args(argv)
    try:
        if args.workdir is None:
            if args.config is None:
                print("error: pass --workdir=W (a run past its cold start) or --config=NAME (its first stages run "
                      "in the config's workdir, or in --workdir)", file=sys.stderr)
                return 2
            args.workdir = resolve_config([f"--config={args.config}", *args.overrides]).workdir
            print(f"workdir: {args.workdir} (the config's; --workdir=W to choose)", file=sys.stderr)
        if not _cold_start_done(args.workdir):
            if args.config is None:
                print(f"{args.workdir!r} has no finished cold start; pass --config=NAME to run it there first",
                      file=sys.stderr)
                return 2
            _prepare(args)
        elif args.config is not None or args.overrides:
            print(f"note: {args.workdir!r} already has a cold start; --config and overrides are ignored",
                  file=sys.stderr)
        run = load_composer_run(args.workdir, "cold_start")
        tasks = run.ctx.source.tasks(args.split)[: args.num_tasks]
        rows = measure(run, tasks)
        for name, lp in oracle_logprob(run, tasks).items():
            rows[name]["oracle_logprob"] = lp
        no_tool = no_tool_baseline(run.ctx.source.make_env, tasks)
    except (ValueError, *USER_ERRORS) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows, no_tool), flush=True)
    files.write_text(files.join(args.workdir, RESULT_FILE),  # local or gs://
                     json.dumps({"split": args.split, "tasks": len(tasks), "no_tool_baseline": no_tool, "rows": rows},
                                indent=1))
    return 0

