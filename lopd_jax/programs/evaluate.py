"""Evaluate a policy on an environment family: success rate, mean reward, Table 3 statistics.

    python -m lopd_jax.evaluate --model=HF_DIR_or_tiny --env=synthetic --split=heldout \\
        [--num_tasks N] [--out FILE] [--temperature 0.7 --top_p 0.95 --top_k 20] ...

``--model`` is a Hugging Face checkpoint directory (or ``gs://`` prefix), a run's export (its
``lopd_run.json`` fills unset options, :func:`fill_run_defaults`) or ``tiny`` (random weights);
``--composer_from=WORKDIR`` evaluates the run's theta0 with its composer's latents ("Base +
Composer"). Tasks roll out in batches on the rollout engine; task ``i`` is episode ``i`` under
``--seed`` whatever the batch. ``--suite=tool_use|code|all --data_dir=DIR`` runs the paper's
Tables 1 and 2 (:mod:`lopd_jax.programs.eval_suite`). On a pod, run the same command on every
host (``docs/pods.md``); process 0 prints and writes the results. Bad arguments exit with
status 2. Details: ``docs/evaluation.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.envs.registry import get_task_source, known_task_sources
from lopd_jax.io import files
from lopd_jax.io.paths import resolve_path
from lopd_jax.method.eval_stats import behaviour_stats
from lopd_jax.programs import eval_suite
from lopd_jax.programs.acebench_user import user_simulator
from lopd_jax.programs.composer_eval import ComposerRun, eval_layout, load_composer_run, rows_latent_context
from lopd_jax.programs.policy import TINY, load_policy, sharded_params
from lopd_jax.settings.sections import EngineConfig, RolloutConfig, SamplingParams
from train import distributed, mesh as mesh_lib
from train.distributed import sync
from lopd_jax.rollout.engine import Engine
from train.launch import add_launch_flags, initialize_from_flags
from train.metrics import Progress
from lopd_jax.rollout.episodes import rollout
from train.run_reader import export_run_info, read_export_run_info


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""

    p = argparse.ArgumentParser(prog="python -m lopd_jax.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face checkpoint dir / gs:// prefix, or 'tiny'")
    p.add_argument("--composer_from", default=None,
                   help="a training run's workdir: evaluate its base model conditioned on its composer's latents")
    p.add_argument("--composer_stage", default="auto", choices=("auto", "lopd", "cold_start"),
                   help="which composer checkpoint of --composer_from (auto: lopd, else cold_start)")
    p.add_argument("--env", default=None,
                   help=f"task source, one of {known_task_sources()} (default synthetic; with --composer_from "
                        "the run's own source)")
    p.add_argument("--env_kwargs", default=None,
                   help="JSON object of task-source arguments (default: the run's, for a run's export on its own "
                        "source; else {})")
    p.add_argument("--split", default="heldout", choices=("train", "heldout"))
    p.add_argument("--num_tasks", type=int, default=None, help="evaluate the first N tasks (default: all)")
    p.add_argument("--out", default=None, help="write the metrics and per-task results here (JSON)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (refused without it)")
    sp, caps = SamplingParams(), RolloutConfig()
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy (default {sp.temperature}; with --suite 0, greedy pass@1)")
    p.add_argument("--top_p", type=float, default=sp.top_p)
    p.add_argument("--top_k", type=int, default=sp.top_k, help="0 = off")
    p.add_argument("--max_steps", type=int, default=None,
                   help=f"environment steps per episode (default: the run's; else {caps.max_env_steps})")
    p.add_argument("--max_turn_tokens", type=int, default=None,
                   help=f"tokens per model turn (default: the run's; else {caps.max_turn_tokens})")
    p.add_argument("--max_total_tokens", type=int, default=None,
                   help=f"tokens per episode (default: the run's; else {caps.max_total_tokens})")
    p.add_argument("--batch_size", type=int, default=32, help="episodes handed to the engine together")
    p.add_argument("--slots", type=int, default=None, help="the engine's decode slots (default: --batch_size)")
    p.add_argument("--env_workers", type=int, default=0,
                   help="threads for environment steps (0: on the engine's thread)")
    p.add_argument("--chat_format", default=None, help="chat format family (default: the model's family)")
    p.add_argument("--enable_thinking", action="store_true", default=None,
                   help="let the model open a <think> block (default: the run's setting for its export)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--success_threshold", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("evaluation suite (the paper's Tables 1 and 2; lopd_jax.programs.eval_suite)")
    s.add_argument("--suite", default=None, choices=("tool_use", "code", "all"),
                   help="run the benchmark suite and write report.md / report.json (instead of --env)")
    s.add_argument("--data_dir", default=None, help="folder of the benchmark data files (see docs/evaluation.md)")
    s.add_argument("--out_dir", default=None,
                   help="where report.md / report.json go (default: DATA_DIR/reports/SUITE-MODEL, one folder per "
                        "suite and model)")
    s.add_argument("--suite_samples", type=int, default=1, help="samples per problem (pass@k, unbiased)")
    s.add_argument("--suite_limit", type=int, default=None,
                   help="the first N problems of each benchmark (and of each BFCL subset); default all")
    s.add_argument("--grading_workers", type=int, default=2, help="parallel grading / environment threads")
    s.add_argument("--acebench_user_model", default=None,
                   help="Hugging Face checkpoint (or 'tiny') simulating ACEBench's multi-turn user "
                        "(default: the evaluated policy; lopd_jax.programs.acebench_user)")
    add_launch_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; any bad value exits with status 2 and a message naming the fix."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) == (args.composer_from is None):
        parser.error("pass exactly one of --model (a policy) or --composer_from (a run's base + composer)")
    if args.composer_from is not None:
        if not files.exists(files.join(args.composer_from, "config.json")):  # local or gs://
            parser.error(f"--composer_from={args.composer_from!r} is not a training run directory (no config.json)")
        if args.env is not None or args.env_kwargs is not None:
            parser.error("--env and --env_kwargs do not apply with --composer_from (the run's own task source is used)")
    elif args.model != TINY and not args.model.startswith("gs://") and not os.path.isdir(args.model):
        parser.error(f"--model={args.model!r} is neither 'tiny' nor an existing checkpoint directory")
    if args.env is not None and args.env not in known_task_sources():
        parser.error(f"--env={args.env!r} is unknown; choose one of {known_task_sources()}")
    if args.env_kwargs is not None:
        try:
            args.env_kwargs = json.loads(args.env_kwargs)
        except json.JSONDecodeError as e:
            parser.error(f"--env_kwargs is not valid JSON ({e.msg}); pass e.g. '{{\"n_heldout_per_family\": 4}}'")
        if not isinstance(args.env_kwargs, dict):
            parser.error("--env_kwargs must be a JSON object")
    if args.temperature is None:
        args.temperature = 0.0 if args.suite else SamplingParams().temperature
    if args.suite is not None:
        _check_suite_args(parser, args)
    checks = [
        (args.num_tasks is None or args.num_tasks >= 1, "--num_tasks must be >= 1"),
        (args.temperature >= 0, "--temperature must be >= 0 (0 = greedy)"),
        (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
        (args.top_k >= 0, "--top_k must be >= 0 (0 = off)"),
        (args.max_steps is None or args.max_steps >= 1, "--max_steps must be >= 1"),
        (args.max_turn_tokens is None or args.max_turn_tokens >= 1, "--max_turn_tokens must be >= 1"),
        (args.max_total_tokens is None or args.max_total_tokens >= 2, "--max_total_tokens must be >= 2"),
        (args.batch_size >= 1, "--batch_size must be >= 1"),
        (args.slots is None or args.slots >= 1, "--slots must be >= 1"),
        (args.env_workers >= 0, "--env_workers must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    if args.out is not None and "://" not in args.out:
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            parser.error(f"--out={args.out!r}: directory {parent!r} does not exist")
        if os.path.isdir(args.out) or (os.path.exists(args.out) and not args.overwrite):
            parser.error(f"--out={args.out!r} exists; " + ("it is a directory: give a file name" if os.path.isdir(
                args.out) else "pass --overwrite to replace it, or choose another --out"))
    return args


def _check_suite_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The --suite options' checks (exit 2 with a message)."""
    if args.data_dir is None or "://" in args.data_dir:
        parser.error(f"--suite needs --data_dir, a local folder of benchmark files (got {args.data_dir!r}); "
                     "see docs/evaluation.md, \"Rows and data files\"")
    if not os.path.isdir(args.data_dir):
        parser.error(f"--data_dir={args.data_dir!r} does not exist. Create it (mkdir -p {args.data_dir}) and place "
                     "the benchmark files there: docs/evaluation.md, \"Rows and data files\", names each file and "
                     "where upstream publishes it (EnvScaler, ACEBench, LiveCodeBench, HumanEval+, MBPP+). "
                     "HumanEval and BFCL come from installed packages; a row whose files are missing is "
                     "reported as not run.")
    if args.env is not None or args.env_kwargs is not None or args.out is not None:
        parser.error("--env, --env_kwargs and --out do not apply with --suite (see --data_dir, --out_dir)")
    if args.suite_samples < 1 or (args.suite_limit is not None and args.suite_limit < 1):
        parser.error("--suite_samples and --suite_limit must be >= 1")
    if args.grading_workers < 1:
        parser.error("--grading_workers must be >= 1")
    args.out_dir = args.out_dir or default_out_dir(args)


def default_out_dir(args: argparse.Namespace) -> str:
    """``<data_dir>/reports/<suite>-<model>``: one folder per suite and evaluated model, so the
    reports of two invocations (a checkpoint, a run's base + composer) do not overwrite each other."""
    if args.composer_from is not None:
        tag = f"{os.path.basename(os.path.normpath(args.composer_from))}_base_composer"
    else:
        parts = os.path.normpath(args.model).split(os.sep)
        tag = "_".join(p for p in parts[-2:] if p not in ("", ".", ".."))
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", tag).strip("_") or "model"
    return os.path.join(args.data_dir, "reports", f"{args.suite}-{tag}")


def rollout_batch(engine, params, fmt, make_env, tasks, rng, config, sampling, latents_for=None,
                  on_finish=None, first_episode: int = 0) -> list:
    """Trajectories of every task of ``tasks`` (one batch, the same list on every process),
    in order, on every process; task ``i`` is episode ``first_episode + i``.

    One process rolls out the whole batch. On several, each process rolls out an even,
    contiguous share on its own engine and the trajectories are gathered
    (:func:`train.distributed.allgather_list`). ``latents_for(tasks, lo, hi)`` gives the
    :class:`lopd_jax.rollout.episodes.LatentContext` of ``tasks[lo:hi]`` (Base + Composer);
    ``on_finish`` is :func:`lopd_jax.rollout.episodes.rollout`'s progress callback (this process's
    episodes).
    """

    tasks = list(tasks)
    per = -(-len(tasks) // jax.process_count())
    lo, hi = (min(len(tasks), jax.process_index() * per + k) for k in (0, per))
    latents = None if latents_for is None else latents_for(tasks, lo, hi)
    mine = rollout(engine, params, fmt, make_env, tasks[lo:hi], rng, config, sampling, latents,
                   first_episode=first_episode + lo, on_finish=on_finish)
    return mine if jax.process_count() == 1 else distributed.allgather_list(mine)


def make_engine(model, fmt, tok, sampling, args, env_workers: int):
    """The rollout engine for ``--model``: ``--slots`` slots (default ``--batch_size``),
    ``env_workers`` environment threads, sampling in ``--dtype`` on one device,
    :class:`lopd_jax.settings.sections.EngineConfig`'s other defaults."""
    config = EngineConfig(slots=getattr(args, "slots", None) or args.batch_size, env_workers=env_workers,
                          dtype=args.dtype)
    return Engine(model, stop_ids=fmt.stop_ids, config=config, sampling=sampling, pad_id=tok.pad_token_id or 0)


def fill_run_defaults(args: argparse.Namespace, run_cfg=None) -> str | None:
    """Fill the options left unset (``None``) in ``args``: the task source, its kwargs, the
    episode caps and ``enable_thinking``. They come from the run that made the policy --
    ``run_cfg`` (the saved config of ``--composer_from``) or the
    :data:`train.run_reader.EXPORT_RUN_FILE` of a run's export given as ``--model`` -- so a
    run's policy is evaluated on the episodes it was trained on (the tiny run's are 96
    tokens per turn, not a real model's 2,048); otherwise the ``synthetic`` source and
    :class:`lopd_jax.settings.sections.RolloutConfig`'s defaults. The run's task-source kwargs apply
    only to its own source. Returns a line saying what came from a run, or None."""

    if run_cfg is not None:
        info, origin = export_run_info(run_cfg), f"the run in {args.composer_from}"
    elif args.model not in (None, TINY):
        info, origin = read_export_run_info(args.model), f"the run that exported {args.model}"
    else:
        info, origin = None, None
    info = info or {}
    env, caps = info.get("env", {}), info.get("rollout", {})
    taken = []
    if args.composer_from is not None:  # the run's own task source, as it is (parse_args forbids --env)
        args.env, args.env_kwargs = env["source"], dict(env["kwargs"])
    if args.env is None:
        args.env = env.get("source", "synthetic")
        taken += ["env"] if "source" in env else []
    if args.env_kwargs is None:
        same_source = args.env == env.get("source")
        args.env_kwargs = dict(env.get("kwargs", {})) if same_source else {}
        taken += ["env_kwargs"] if same_source and "kwargs" in env else []
    default = RolloutConfig()
    for flag, key in (("max_steps", "max_env_steps"), ("max_turn_tokens", "max_turn_tokens"),
                      ("max_total_tokens", "max_total_tokens")):
        if getattr(args, flag) is None:
            setattr(args, flag, int(caps.get(key, getattr(default, key))))
            taken += [flag] if key in caps else []
    if args.enable_thinking is None:
        args.enable_thinking = bool(info.get("chat", {}).get("enable_thinking", False))
    if not taken:
        return None
    return (f"settings from {origin} ({', '.join(taken)}; flags override): env {args.env} "
            f"{json.dumps(args.env_kwargs)}, max_steps {args.max_steps}, max_turn_tokens {args.max_turn_tokens}, "
            f"max_total_tokens {args.max_total_tokens}")


def load_evaluated(args: argparse.Namespace, sampling: SamplingParams, run: ComposerRun | None = None,
                   env_workers: int | None = None) -> tuple[Any, Engine, Any]:
    """``(chat format, engine, parameters)`` of the evaluated policy: ``run``'s (a loaded
    ``--composer_from`` run: its base model on its engine), else ``--model`` loaded here, sharded
    over every host's devices on a pod, on :func:`make_engine`'s engine. ``env_workers``: the
    engine's environment threads (None: a run's own; for ``--model``, 0)."""
    if run is not None:
        engine = run.ctx.engine
        if env_workers is not None:
            engine = copy.copy(engine)
            engine.config = dataclasses.replace(engine.config, env_workers=env_workers)
        return run.ctx.fmt, engine, run.base_params()
    rules = None
    if jax.process_count() > 1:  # the policy sharded over every host's devices
        rules = mesh_lib.rules_for(mesh_lib.make_mesh())
    model, tok, family = load_policy(args.model, seed=args.seed, dtype=args.dtype, rules=rules)
    # a checkpoint renders prompts with its own chat template (apply_chat_template)
    fmt = make_chat_format(args.chat_format or family, tok, enable_thinking=args.enable_thinking,
                           use_tokenizer_template=args.model != TINY and bool(getattr(tok, "chat_template", None)))
    engine = make_engine(model, fmt, tok, sampling, args, env_workers or 0)
    params = Engine.params_of(model) if rules is None else sharded_params(model, rules)
    return fmt, engine, params


def latents_of(run: ComposerRun | None):
    """The ``latents_for(batch, lo, hi)`` of a composer run's rows (None without a run)."""
    if run is None:
        return None
    return lambda batch, lo, hi: rows_latent_context(run, batch, lo, hi)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Roll out the tasks of ``args`` and return ``{"metrics", "trajectories", "config"}``."""

    run = None
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    if args.composer_from is not None:
        run = load_composer_run(args.composer_from, args.composer_stage)
        source = run.ctx.source
        _note(fill_run_defaults(args, run.ctx.cfg))
    else:
        _note(fill_run_defaults(args))
        try:
            source = get_task_source(args.env, **args.env_kwargs)
        except TypeError as e:
            raise ValueError(f"--env_kwargs do not fit the {args.env!r} task source: {e}") from e
    # a composer run keeps its engine's environment threads; --env_workers sizes --model's
    fmt, engine, params = load_evaluated(args, sampling, run, args.env_workers if run is None else None)
    tasks = source.tasks(args.split)
    if args.num_tasks is not None:
        tasks = tasks[: args.num_tasks]
    if not tasks:
        raise ValueError(f"the {args.env or 'run'!r} source has no {args.split!r} tasks")
    config = RolloutConfig(max_env_steps=args.max_steps, max_turn_tokens=args.max_turn_tokens,
                           max_total_tokens=args.max_total_tokens)
    rng = jax.random.key(args.seed)
    start = time.perf_counter()
    latents_for = latents_of(run)
    trajs = []
    with Progress(len(tasks), "evaluate", unit="episode") as bar:
        # each process reports the episodes it rolls out: on a pod process 0's bar is its share
        for i in range(0, len(tasks), args.batch_size):
            trajs += rollout_batch(engine, params, fmt, source.make_env, tasks[i:i + args.batch_size], rng, config,
                                   sampling, latents_for, on_finish=bar.update, first_episode=i)
    elapsed = time.perf_counter() - start
    metrics = behaviour_stats(trajs, success_threshold=args.success_threshold)
    metrics["rollout_seconds"] = round(elapsed, 3)
    metrics["trajectories_per_minute"] = round(60.0 * len(trajs) / elapsed, 2)
    per_task = [{"task_id": t.task.task_id, "family": t.task.family, "reward": t.reward,
                 "finish_reason": t.finish_reason, "num_turns": t.num_turns, "turn_lengths": t.turn_lengths,
                 "turn_ids": turn_ids(t), "env_stats": t.env_stats, "mean_raw_logprob": _mean_generated(t.raw_logprobs, t.mask)}
                for t in trajs]
    if run is not None:
        metrics["composer"] = {"workdir": args.composer_from, "stage": run.stage, "step": run.step,
                               "latent_slots": eval_layout(run.ctx).num_slots,
                               "block_tokens": eval_layout(run.ctx).length}
    return {"config": vars(args), "metrics": metrics, "trajectories": per_task}


def suite(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.suite``'s benchmarks (:mod:`lopd_jax.programs.eval_suite`) with the policy of
    ``--model`` (or ``--composer_from``'s base + composer) and return the report."""

    start = time.perf_counter()
    eval_suite.check_data_dir(args.data_dir, args.suite)  # an ambiguous folder: exit 2 before any work
    if args.enable_thinking is None:
        args.enable_thinking = eval_suite.SUITE_DEFAULTS["enable_thinking"]
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    run = None if args.composer_from is None else load_composer_run(args.composer_from, args.composer_stage)
    fmt, engine, params = load_evaluated(args, sampling, run, args.grading_workers)
    latents_for = latents_of(run)
    rng = jax.random.key(args.seed)

    def roll(tasks, sample, make_env, caps, name):
        config = RolloutConfig(**caps)
        key = jax.random.fold_in(rng, sample)
        out = []
        with Progress(len(tasks), f"{name} [{sample + 1}/{args.suite_samples}]", unit="episode") as bar:
            for i in range(0, len(tasks), args.batch_size):
                out += rollout_batch(engine, params, fmt, make_env, tasks[i:i + args.batch_size], key, config,
                                     sampling, latents_for, on_finish=bar.update, first_episode=i)
        return out

    user = None
    if args.suite in ("tool_use", "all") and jax.process_count() == 1:
        user = user_simulator(args, engine, params, fmt)
    rows = []
    for bench in eval_suite.suite_benchmarks(args.suite):
        row = eval_suite.run_benchmark(bench, roll, args, user=user)
        if row["status"] != "ok":
            _note(f"suite: {bench.name}: {row['status']}: {row['reason']}")
        rows.append(row)
    decoding = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "enable_thinking": bool(args.enable_thinking),
                "max_turn_tokens": args.max_turn_tokens or eval_suite.SUITE_DEFAULTS["max_turn_tokens"],
                "max_total_tokens": args.max_total_tokens or eval_suite.SUITE_DEFAULTS["max_total_tokens"],
                "samples_per_problem": args.suite_samples}
    return {"suite": args.suite, "model": args.model or f"composer run {args.composer_from}",
            "data_dir": args.data_dir, "decoding": decoding, "limit_per_benchmark": args.suite_limit,
            "rows": rows, "wall_s": round(time.perf_counter() - start, 2)}


def _note(line: str | None) -> None:
    """Print ``line`` (if any) to stderr on process 0."""
    if line and jax.process_index() == 0:
        print(f"[lopd] evaluate: {line}", file=sys.stderr, flush=True)


def turn_ids(traj) -> list[list[int]]:
    """The generated ids of each assistant turn of a :class:`lopd_jax.rollout.episodes.Trajectory` (its
    tokens where ``mask`` is 1, split by ``turn_lengths``)."""
    gen = np.asarray(traj.tokens)[np.asarray(traj.mask) == 1].tolist()
    cuts = np.cumsum([0, *traj.turn_lengths])
    return [gen[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _mean_generated(values, mask) -> float:
    """Mean of ``values`` over generated tokens (``mask`` 1), 0.0 when there are none."""
    m = np.asarray(mask) > 0
    return float(np.asarray(values)[m].mean()) if m.any() else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""

    args = parse_args(argv)
    error = initialize_from_flags(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.model not in (None, TINY):
        args.model = resolve_path(args.model)
    args.composer_from, args.out = resolve_path(args.composer_from), resolve_path(args.out)
    if args.suite is not None:
        return _main_suite(args)
    try:
        result = evaluate(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:  # every process holds every trajectory; one writes
        print(json.dumps(result["metrics"], indent=2))
        if args.out:
            files.write_text(args.out, json.dumps(result, indent=2))  # local or gs://
    sync("evaluate_written")
    return 0


def _main_suite(args: argparse.Namespace) -> int:
    """``main`` for ``--suite``: run it, write the reports on process 0, print the rows."""

    try:
        report = suite(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        json_path, md_path = eval_suite.write_report(report, args.out_dir)
        for row in report["rows"]:
            score = row.get("status", "not run") if row["score"] is None else f"{row['score']:.1f}"
            print(f"{row['benchmark']}: {score}")
        print(f"wrote {md_path} and {json_path}")
    sync("evaluate_written")
    return 0

