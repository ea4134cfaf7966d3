"""Run arms x seeds (x a grid) of one config side by side, resumably, and report them.

    python -m lopd_jax.sweep --config=NAME --arms=lopd,grpo,lopd@steps.margin=0 \\
        --seeds=0,1,2 --workdir=W [--grid steps.margin=0,0.01,0.05] [dotted.key=value ...]

Every combination (arm, grid point, seed) is one ordinary ``lopd_jax.train`` run in
``W/runs/<name>/seed<k>``, run as a subprocess; a finished run is skipped and an
interrupted one resumes, so rerunning the sweep continues it. Before a run starts, the
stages it shares with an earlier run of the sweep (warm-up, evaluation before, bank, and
the cold start for composer arms; :func:`stage_keys`) are copied in. The report
(:mod:`lopd_jax.sweep_report`: ``results.json``, ``results.md``, Figures 3-5) is rebuilt
with ``--report_only``. Exit status: 0 all finished, 1 some run failed, 2 bad arguments.
Details: docs/baselines.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from typing import Any, Sequence

from lopd_jax.io.paths import REPO_ROOT, resolve_path
from lopd_jax.io.progress import describe_run, format_seconds, run_and_follow
from lopd_jax.programs.launcher import check_workdir
from lopd_jax.programs.sweep_report import write_report
from lopd_jax.settings.arm_config import ARMS, resolve_arm, uses_composer
from lopd_jax.settings.errors import ConfigError
from configs import load_config
from lopd_jax.settings.overrides import apply_overrides
from lopd_jax.settings.run_config import flatten

SHARED_FILE = "shared_stages.json"
PRE_STAGES = ("warmup", "eval_before", "bank")
COLD_STAGES = ("cold_start",)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the sweep: ``name`` (arm plus grid point), ``seed``, its overrides."""

    arm: str
    seed: int
    grid: tuple[tuple[str, str], ...]
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        """``arm`` or ``arm__key=value__...`` (directory name of the run's seeds)."""
        return "__".join([self.arm] + [f"{k}={v}" for k, v in self.grid])

    def workdir(self, root: str) -> str:
        """``<root>/runs/<name>/seed<k>``."""
        return os.path.join(root, "runs", self.name, f"seed{self.seed}")

    def train_args(self, config: str, root: str) -> list[str]:
        """The ``python -m lopd_jax.train`` arguments of this run."""
        return [f"--config={config}", f"--workdir={self.workdir(root)}", *self.overrides,
                *[f"{k}={v}" for k, v in self.grid], f"arm={self.arm}", f"seed={self.seed}"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="a configs/NAME.py config (default tiny)")
    p.add_argument("--arms", default="lopd", help=f"comma-separated arms, of {', '.join(ARMS)}; an arm "
                   "variant is ARM@key=value[@key=value], e.g. lopd@steps.margin=0")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--workdir", required=True, help="sweep directory (runs, results, figures)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="sweep one config field over values (repeatable: the product of grids)")
    p.add_argument("--threshold", type=float, default=None,
                   help="held-out reward for 'rollouts to threshold' (default: halfway from the mean "
                        "reward before training to the best arm's final mean)")
    p.add_argument("--no_base_composer", action="store_true",
                   help="skip the Base + Composer evaluation of composer arms")
    p.add_argument("--report_only", action="store_true", help="only rebuild results/table/figures")
    p.add_argument("overrides", nargs="*", help="dotted overrides key=value for every run")
    return p


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def plan(args) -> list[RunSpec]:
    """Every run of the sweep, seeds outermost (so seed 0 of every arm finishes first),
    validated by loading each run's config (ConfigError on a bad arm / key / value)."""
    arms = []  # (arm, its own overrides): "lopd@steps.margin=0" is lopd with m = 0
    for entry in _split(args.arms):
        arm, *own = entry.split("@")
        if any("=" not in o for o in own):
            raise ConfigError(f"--arms entry {entry!r}: write an arm variant as ARM@key=value[@key=value]")
        arms.append((arm, tuple(tuple(o.split("=", 1)) for o in own)))
    bad = [a for a, _ in arms if a not in ARMS]
    if not arms or bad:
        raise ConfigError(f"--arms={args.arms!r}: unknown arm(s) {bad}; choose from {list(ARMS)}")
    try:
        seeds = [int(s) for s in _split(args.seeds)]
    except ValueError:
        raise ConfigError(f"--seeds={args.seeds!r}: expected comma-separated integers") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    axes = []
    for g in args.grid:
        if "=" not in g or not _split(g.split("=", 1)[1]):
            raise ConfigError(f"--grid {g!r} must look like KEY=V1,V2,...")
        key, vals = g.split("=", 1)
        axes.append([(key.strip(), v) for v in _split(vals)])
    points = [tuple(p) for p in itertools.product(*axes)] if axes else [()]
    specs = [RunSpec(a, s, own + p, tuple(args.overrides)) for s in seeds for a, own in arms for p in points]
    for spec in specs:
        run_config(args.config, spec, args.workdir)  # fail fast, before any run starts
    return specs


def run_config(config: str, spec: RunSpec, root: str):
    """The resolved :class:`TrainConfig` of one run (arm implications applied)."""
    cfg = load_config(config)
    cfg = apply_overrides(cfg, [*spec.overrides, *[f"{k}={v}" for k, v in spec.grid], f"arm={spec.arm}",
                                f"seed={spec.seed}", f"workdir={spec.workdir(root)}"])
    return resolve_arm(cfg)


# ----------------------------------------------------------------------------- shared stages

# Config keys (dotted prefixes) each shared stage group reads; the seed is always included.
PRE_KEYS = ("model.", "env.", "rollout.", "bank.", "mesh.", "composer.lora.", "stages.warmup_", "stages.eval_tasks")
COLD_KEYS = PRE_KEYS + ("composer.", "steps.cold_start_", "stages.cold_start_")


def stage_keys(cfg) -> dict[str, str]:
    """``{"pre": hash, "cold": hash}``: content hashes of the config entries the warm-up /
    evaluation-before / bank stages (``pre``) and the cold start (``cold``) depend on."""
    flat = flatten(cfg)

    def h(prefixes):
        part = {k: v for k, v in flat.items() if k == "seed" or any(k.startswith(p) for p in prefixes)}
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]
    return {"pre": h(PRE_KEYS), "cold": h(COLD_KEYS)}


def _read(path: str, default: Any = None) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def _write(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _copy_metrics(src: str, dst: str, stages: Sequence[str]) -> None:
    lines = []
    if os.path.exists(os.path.join(src, "metrics.jsonl")):
        with open(os.path.join(src, "metrics.jsonl")) as f:
            lines = [ln for ln in f if ln.strip() and json.loads(ln).get("stage") in stages]
    with open(os.path.join(dst, "metrics.jsonl"), "a") as f:
        f.writelines(lines)


def adopt_stages(src: str, dst: str, stages: Sequence[str]) -> list[str]:
    """Copy the finished ``stages`` of run ``src`` into run ``dst`` (checkpoints, bank,
    metrics records, ``stages.json`` entries); returns the stages copied. A stage already
    done in ``dst`` is left alone."""
    s_ledger = _read(os.path.join(src, "stages.json"), {})
    d_ledger = _read(os.path.join(dst, "stages.json"), {})
    todo = [s for s in stages if s_ledger.get(s, {}).get("done") and not d_ledger.get(s, {}).get("done")]
    if not todo:
        return []
    os.makedirs(dst, exist_ok=True)
    for stage in todo:
        entry = dict(s_ledger[stage])
        ck = os.path.join(src, "checkpoints", stage)
        if os.path.isdir(ck):
            shutil.copytree(ck, os.path.join(dst, "checkpoints", stage), dirs_exist_ok=True)
        if stage == "bank":
            shutil.copytree(entry["path"], os.path.join(dst, "bank"), dirs_exist_ok=True)
            entry["path"] = os.path.join(dst, "bank")
        entry["shared_from"] = src
        d_ledger[stage] = entry
    _copy_metrics(src, dst, todo)
    _write(os.path.join(dst, "stages.json"), d_ledger)
    return todo


def share_into(root: str, cfg, workdir: str) -> list[str]:
    """Copy shareable finished stages into ``workdir`` from the run registered for its
    keys in ``<root>/shared_stages.json``; returns what was copied."""
    reg = _read(os.path.join(root, SHARED_FILE), {})
    keys = stage_keys(cfg)
    copied = []
    if keys["pre"] in reg and reg[keys["pre"]] != workdir:
        copied += adopt_stages(reg[keys["pre"]], workdir, PRE_STAGES)
    if uses_composer(cfg) and keys["cold"] in reg and reg[keys["cold"]] != workdir:
        copied += adopt_stages(reg[keys["cold"]], workdir, COLD_STAGES)
    return copied


def register(root: str, cfg, workdir: str) -> None:
    """Record ``workdir`` as the source of its stage keys (for the stages it finished)."""
    path = os.path.join(root, SHARED_FILE)
    reg = _read(path, {})
    ledger = _read(os.path.join(workdir, "stages.json"), {})
    keys = stage_keys(cfg)
    if all(ledger.get(s, {}).get("done") for s in PRE_STAGES):
        reg.setdefault(keys["pre"], workdir)
    if uses_composer(cfg) and ledger.get("cold_start", {}).get("done"):
        reg.setdefault(keys["cold"], workdir)
    _write(path, reg)


# ----------------------------------------------------------------------------- running


def finished(workdir: str) -> bool:
    """Whether the run in ``workdir`` completed (its export is recorded)."""
    return bool(_read(os.path.join(workdir, "stages.json"), {}).get("export", {}).get("done"))


def _env() -> dict[str, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_one(config: str, spec: RunSpec, root: str, base_composer: bool) -> dict[str, Any]:
    """Run (or resume, or skip) one run; returns ``{"status", "seconds", "shared"}``."""
    cfg = run_config(config, spec, root)
    wd = spec.workdir(root)
    status: dict[str, Any] = {"status": "done", "seconds": 0.0, "shared": []}
    if not finished(wd):
        status["shared"] = share_into(root, cfg, wd)
        os.makedirs(wd, exist_ok=True)
        t0 = time.perf_counter()
        code = run_and_follow([sys.executable, "-m", "lopd_jax.train", *spec.train_args(config, root)],
                              os.path.join(wd, "train.log"), describe_run(
                                  wd, f"[sweep]   {spec.name} seed {spec.seed}", cfg.stages.lopd_steps),
                              cwd=REPO_ROOT, env=_env())
        status["seconds"] = time.perf_counter() - t0
        if code != 0 or not finished(wd):
            status["status"] = f"failed (exit {code}; see {os.path.join(wd, 'train.log')})"
            return status
        status["status"] = "ran"
    register(root, cfg, wd)
    if base_composer and uses_composer(cfg) and not os.path.exists(os.path.join(wd, "base_composer.json")):
        run_and_follow([sys.executable, "-m", "lopd_jax.sweep_report", "base-composer", wd],
                       os.path.join(wd, "train.log"),
                       lambda t: f"[sweep]   {wd}: the Base + Composer evaluation, {format_seconds(t)}",
                       cwd=REPO_ROOT, env=_env())
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (exit codes in the module docstring)."""

    args = build_parser().parse_args(argv)
    args.workdir = resolve_path(args.workdir)  # checkpoints need absolute paths; runs start elsewhere
    try:
        check_workdir(args.workdir)
        if args.report_only and not os.path.isdir(args.workdir):
            raise ConfigError(f"--workdir={args.workdir}: no such sweep directory; give the --workdir of a sweep, "
                              f"or drop --report_only to run one there")
        specs = plan(args)
    except (ConfigError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    _write(os.path.join(args.workdir, "sweep.json"), {"config": args.config, "arms": _split(args.arms),
                                                       "seeds": _split(args.seeds), "grid": args.grid,
                                                       "overrides": args.overrides})
    failures = 0
    if not args.report_only:
        t_all = time.perf_counter()
        for i, spec in enumerate(specs):
            print(f"[sweep] {i + 1}/{len(specs)} {spec.name} seed {spec.seed}", file=sys.stderr, flush=True)
            st = run_one(args.config, spec, args.workdir, not args.no_base_composer)
            failures += st["status"].startswith("failed")
            print(f"[sweep]   {st['status']} in {st['seconds']:.0f}s"
                  f"{'; shared ' + ','.join(st['shared']) if st['shared'] else ''}", file=sys.stderr, flush=True)
        print(f"[sweep] all runs: {time.perf_counter() - t_all:.0f}s", file=sys.stderr, flush=True)
    paths = write_report(args.workdir, specs, threshold=args.threshold)
    print("\n".join(paths))
    return 1 if failures else 0

