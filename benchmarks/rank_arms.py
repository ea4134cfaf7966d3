"""Rank arms from the finished runs of one grid (one prefix or several), with intervals.

    python -m benchmarks.rank_arms --workdir=W [--stage=eval_after] [--since=eval@K] [--resamples=10000]
        [--json=OUT] [--figure=OUT.png]

``W`` is a directory :mod:`benchmarks.miniature_core` wrote (``W/runs/ARM_sSEED``; with
several prefixes ``W/runs/ARM_pP_sSEED``, whose contrasts pair runs within each prefix P
and take the prefix as the run unit: :func:`lopd_jax.programs.arm_stats.prefix_means`) or a
:mod:`lopd_jax.sweep` directory (``W/runs/NAME/seedK``; ``lopd__steps.margin=0`` is the arm
``m0``). Only finished runs are read (those whose ``stage`` kept per-task outcomes); the
missing ones are listed. The pre-registered contrasts (LOPD against the frozen composer,
m = 0, GRPO, the same experiences given as text and OPSD, the last an upper bound: OPSD's
hint is the oracle call) take the
paired cluster-level t over the held-out tasks' cluster keys (customer for the hub family;
:func:`lopd_jax.method.statistics.cluster_t`), with the cluster bootstrap beside it as a
secondary column, Holm-corrected over the finished contrasts of the table; the ranking states only
what a corrected interval separates. ``ARM_asyncK`` beside
``ARM`` adds the family ``ARM_asyncK - ARM`` (what staleness K costs). The primary metric is
the student's teacher-forced probability of the oracle call's hidden-rule argument
(``oracle_arg_prob``, kept per task on hidden-rule families), the secondary the greedy
held-out reward (docs/statistics.md). ``--stage=eval@K`` compares the held-out evaluation
after training step K instead of the last; ``--since=S`` compares what each run gained from
its evaluation ``S`` to ``--stage`` (per task, on the same tasks: e.g. the recovery after a
drift at step K, ``--since=eval@K``). ``--figure`` draws every contrast's estimate and
95% interval, the primary's and the secondary's side by side (filled: the Holm-corrected
interval excludes 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from lopd_jax.method.statistics import RESAMPLES, sample_sd
from lopd_jax.programs.arm_stats import (arm_label, change_outcomes, cluster_name, contrast_family, family_note,
                                          format_contrasts, ranking, run_outcomes, select_clusters)

CONTRASTS = (("lopd", "lopd_frozen_composer"), ("lopd", "m0"), ("lopd", "grpo"), ("lopd", "experiences_text"),
             ("lopd", "opsd"))
PRIMARY = "oracle_arg_prob"  # train.oracle_scores.KEY: the per-task key of the primary metric
SECONDARY = "reward"
_MINIATURE = re.compile(r"^(?P<arm>.+?)(?:_p(?P<prefix>\d+))?_s(?P<seed>\d+)$")
_SWEEP_SEED = re.compile(r"^seed(?P<seed>\d+)$")
ASYNC_ARM = re.compile(r"^(?P<arm>.+)_(?P<mode>async|partial)(?P<k>\d+)$")
#: the sweep's grid entries of partial rollouts in finished order (an ARM_partialK run)
PARTIAL_GRID = ("rollout.partial=true", "rollout.batch_order=finished")


def arm_of(sweep_name: str) -> str:
    """The arm a :mod:`lopd_jax.sweep` run name stands for: ``m0`` for LOPD at margin 0, the
    plain arm for LOPD at another margin, else the name itself."""
    arm, *grid = sweep_name.split("__")
    if "rollout.mode=async" in grid:  # ARM_asyncK / ARM_partialK, K the run's rollout.max_staleness (default 1)
        ks = [g.split("=", 1)[1] for g in grid if g.startswith("rollout.max_staleness=")]
        mode = "partial" if "rollout.partial=true" in grid else "async"
        rest = [g for g in grid if g not in ("rollout.mode=async", *PARTIAL_GRID)
                and not g.startswith("rollout.max_staleness=")]
        return f"{arm_of('__'.join([arm, *rest]))}_{mode}{ks[0] if ks else 1}"
    if arm == "lopd" and grid == ["steps.margin=0"]:
        return "m0"
    if arm == "lopd" and len(grid) == 1 and grid[0].startswith("steps.margin="):
        return "lopd"
    return sweep_name


def staleness_pairs(arms) -> list[tuple[str, str]]:
    """``(ARM_asyncK, ARM)`` / ``(ARM_partialK, ARM)`` for every asynchronous arm whose
    synchronous arm is present."""
    return [(a, m["arm"]) for a in sorted(arms) if (m := ASYNC_ARM.match(a)) and m["arm"] in arms]


def find_runs(workdir: str) -> dict[str, dict[tuple[int | None, int], str]]:
    """Arm -> (prefix, seed) -> run directory, for both layouts (finished or not); the prefix
    is None for runs of a one-prefix grid (``ARM_sSEED``) and P for ``ARM_pP_sSEED``."""
    root = os.path.join(workdir, "runs")
    if not os.path.isdir(root):
        raise ValueError(f"{workdir} has no runs/ directory; pass the --workdir of benchmarks.miniature_core "
                         f"or lopd_jax.sweep")
    out: dict[str, dict[int, str]] = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or name.endswith(".tmp"):
            continue
        m = _MINIATURE.match(name)
        if m and os.path.exists(os.path.join(path, "config.json")):
            prefix = int(m["prefix"]) if m["prefix"] is not None else None
            out.setdefault(m["arm"], {})[(prefix, int(m["seed"]))] = path
            continue
        for sub in sorted(os.listdir(path)):
            s = _SWEEP_SEED.match(sub)
            if s and os.path.isdir(os.path.join(path, sub)):
                out.setdefault(arm_of(name), {})[(None, int(s["seed"]))] = os.path.join(path, sub)
    return out


def collect(workdir: str, stage: str = "eval_after", since: str | None = None,
            keep: list[str] | None = None, drop: tuple[str, ...] = ()) -> tuple[dict[str, list], list[str]]:
    """Finished runs' per-task outcomes per arm (seed order) and the unfinished runs' names;
    with ``since``, each run's per-task change from that evaluation to ``stage``. A run of a
    several-prefix grid carries its ``prefix`` (contrasts pair within it). ``keep`` / ``drop``:
    only the held-out tasks of those cluster keys / all but those (:func:`select_clusters`)."""
    arms: dict[str, list] = {}
    missing = []
    for arm, runs in find_runs(workdir).items():
        for prefix, seed in sorted(runs, key=lambda k: (k[0] is not None, k[0] or 0, k[1])):
            path = runs[(prefix, seed)]
            outcomes = run_outcomes(path, stage)
            before = run_outcomes(path, since) if since else None
            gaps = [name for name, got in ((stage, outcomes), (since, before)) if name and got is None]
            which = f"seed {seed}" if prefix is None else f"prefix {prefix} seed {seed}"
            missing += [f"{arm} {which} ({os.path.relpath(path, workdir)}: no finished {name} "
                        f"with per-task outcomes)" for name in gaps]
            if not gaps:
                run = change_outcomes(outcomes, before) if since else outcomes
                run = select_clusters(run, keep, drop) if keep is not None or drop else run
                arms.setdefault(arm, []).append({**run, "seed": seed, **({} if prefix is None else {"prefix": prefix})})
    return arms, missing


def report(workdir: str, stage: str = "eval_after", resamples: int = RESAMPLES,
           since: str | None = None, keep: list[str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The arms' means, the contrasts and the ranking (see the module docstring); with
    ``since``, of each run's change from evaluation ``since`` to ``stage``; with ``keep`` /
    ``drop``, over the held-out tasks of those cluster keys / of all others."""
    arms, missing = collect(workdir, stage, since, keep, drop)
    for a, b in CONTRASTS:
        for arm in (a, b):
            if arm not in arms:
                missing.append(f"{arm}: no finished run (needed by {a} − {b})")
    means = {arm: [sum(r[SECONDARY]) / len(r[SECONDARY]) for r in runs] for arm, runs in arms.items()}
    has_primary = bool(arms) and all(PRIMARY in r for runs in arms.values() for r in runs)
    key = PRIMARY if has_primary else SECONDARY
    rows = contrast_family(arms, CONTRASTS, key=key, resamples=resamples)
    stale = contrast_family(arms, staleness_pairs(arms), key=key, resamples=resamples)
    out = {"workdir": workdir, "stage": stage, "since": since, "metric": key, "keep": keep, "drop": list(drop),
           "primary_recorded": has_primary, "means": means, "missing": sorted(set(missing)),
           "contrasts": rows, "ranking": ranking(rows), "staleness": stale, "staleness_ranking": ranking(stale),
           "clusters": cluster_name(next(iter(arms.values()))) if arms else None}
    if has_primary:  # the secondary's families too, for the reader (the ranking is the primary's)
        out["primary_means"] = {arm: [sum(r[PRIMARY]) / len(r[PRIMARY]) for r in runs] for arm, runs in arms.items()}
        out["secondary"] = {"contrasts": contrast_family(arms, CONTRASTS, key=SECONDARY, resamples=resamples),
                            "staleness": contrast_family(arms, staleness_pairs(arms), key=SECONDARY,
                                                         resamples=resamples)}
    return out


def format_report(r: dict[str, Any]) -> str:
    """The printed report."""
    pm = r.get("primary_means", {})
    what, unit = _compared(r), " change" if r.get("since") else ""
    lines = [f"arms under {r['workdir']} ({what}; per seed, mean over held-out tasks{_selection(r)}):",
             f"| arm | seeds | greedy reward{unit} | sample SD | {PRIMARY}{unit} | sample SD |", "|---|---|---|---|---|---|"]
    for arm, xs in r["means"].items():
        lines.append(f"| {arm_label(arm)} | {len(xs)} | {_mean_sd(xs)} | {_mean_sd(pm[arm]) if arm in pm else '- | -'} |")
    if not r["primary_recorded"]:
        lines.append(f"primary metric ({PRIMARY}: the student's teacher-forced probability of the oracle tool-call "
                     f"argument) not recorded by these runs; contrasts use the secondary (greedy held-out reward)")
    units = ("seeds averaged within each prefix and cluster, the prefixes' common shift added"
             if any("prefixes" in c for c in r["contrasts"]) else "seeds averaged within each cluster, their common "
             "shift added")
    design = (f"95% paired cluster-level t over the {r['clusters']} clusters of the held-out tasks ({units}; "
              f"docs/statistics.md); p two-sided")
    lines += ["", f"pre-registered contrasts on {r['metric']} ({design}; {family_note(r['contrasts'])}):",
              format_contrasts(r["contrasts"], r["metric"]), "", "ranking (only where a corrected interval excludes 0):"]
    lines += [f"  {x}" for x in r["ranking"]] or ["  nothing to rank"]
    if r.get("staleness"):
        lines += ["", f"what staleness costs on {r['metric']} (ARM_asyncK - ARM, the same seeds and prefix; {design}; "
                      f"{family_note(r['staleness'])}):",
                  format_contrasts(r["staleness"], r["metric"]), ""]
        lines += [f"  {x}" for x in r["staleness_ranking"]]
    if "secondary" in r:
        rows = r["secondary"]["contrasts"] + r["secondary"]["staleness"]
        lines += ["", f"the same contrasts on the secondary, {SECONDARY} (greedy held-out reward; not ranked; Holm "
                      f"within each family above):",
                  format_contrasts(rows, SECONDARY)]
    if r["missing"]:
        lines += ["", "missing:"] + [f"  {m}" for m in r["missing"]]
    return "\n".join(lines)


def _selection(r: dict[str, Any]) -> str:
    """The held-out tasks compared, in words, when ``--clusters`` / ``--except_clusters`` chose them."""
    if r.get("keep") is not None:
        return f" of the clusters {', '.join(r['keep'])}"
    return f" of every cluster but {', '.join(r['drop'])}" if r.get("drop") else ""


def _compared(r: dict[str, Any]) -> str:
    """What the report compares: an evaluation, or each run's change between two."""
    return f"change from {r['since']} to {r['stage']}" if r.get("since") else r["stage"]


def figure(r: dict[str, Any], path: str) -> str:
    """Draw the report's contrasts as intervals (one panel per metric; filled markers: the
    Holm-corrected interval excludes 0) into ``path``; returns ``path``."""
    from lopd_jax.programs.sweep_report import _plt

    panels = [(r["metric"], r["contrasts"] + r.get("staleness", []))]
    if "secondary" in r:
        panels.append((SECONDARY, r["secondary"]["contrasts"] + r["secondary"]["staleness"]))
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 0.55 * len(panels[0][1]) + 1.6),
                             squeeze=False)
    for ax, (metric, rows) in zip(axes[0], panels):
        done = [c for c in rows if not c["missing"]]
        for y, c in enumerate(done):
            ax.errorbar([c["estimate"]], [y], xerr=[[c["estimate"] - c["lo"]], [c["hi"] - c["estimate"]]], fmt="o",
                        color="C0", capsize=4, markerfacecolor="C0" if c["significant"] else "white")
        ax.axvline(0.0, color="grey", lw=0.8, ls="--")
        ax.set_yticks(range(len(done)), [f"{arm_label(c['a'])} − {arm_label(c['b'])}" for c in done])
        ax.invert_yaxis()
        ax.set_xlabel(f"Δ {metric} [95% CI]")
        ax.set_title("ranked" if metric == r["metric"] else "secondary (not ranked)", fontsize=9)
    what = _compared(r)
    fig.suptitle(f"{os.path.basename(os.path.normpath(r['workdir']))} ({what}): paired cluster-level t over "
                 f"{r['clusters']} clusters; filled = Holm-corrected interval excludes 0 (Holm per family)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_sd(xs) -> str:
    sd = sample_sd(xs)
    return f"{sum(xs) / len(xs):.4f} | {'-' if sd != sd else f'{sd:.4f}'}"


def main(argv=None) -> int:
    """Entry point: print the report (and write it as JSON with --json)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.rank_arms", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="benchmarks.miniature_core or lopd_jax.sweep directory")
    p.add_argument("--stage", default="eval_after",
                   help="the held-out evaluation compared: eval_after (default), eval_before or eval@STEP")
    p.add_argument("--since", default=None,
                   help="compare each run's per-task change from this evaluation (e.g. eval@24) to --stage")
    p.add_argument("--resamples", type=int, default=RESAMPLES, help=f"resamples of the secondary cluster bootstrap column (default {RESAMPLES})")
    p.add_argument("--clusters", default=None, help="compare on the held-out tasks of these cluster keys only "
                   "(comma-separated, e.g. dispatch.ship:customer=bob,dispatch.ship:customer=erin)")
    p.add_argument("--except_clusters", default="", help="compare on the held-out tasks of all other cluster keys")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--figure", default=None, help="also draw the contrasts' intervals into this PNG")
    args = p.parse_args(argv)
    try:
        r = report(args.workdir, args.stage, args.resamples, since=args.since,
                   keep=args.clusters.split(",") if args.clusters else None,
                   drop=tuple(c for c in args.except_clusters.split(",") if c))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if args.figure:
        print(f"figure: {figure(r, args.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
