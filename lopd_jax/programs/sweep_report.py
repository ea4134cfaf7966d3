"""The sweep's report: per-run records, the table over seeds and Figures 3-5.

:func:`collect` reads one finished run (``stages.json``, ``metrics.jsonl``, and the
``base_composer.json`` that :func:`base_composer_eval` writes) into a record;
:func:`write_report` writes ``results.json`` (one record per arm x grid point x seed),
``results.md`` (mean +- sample SD over seeds, OPSD's rows marked as an oracle-hint upper
bound, then every pair of run groups with its paired cluster-level t interval,
Holm-corrected over the pairs: :func:`contrasts`) and the figures (see :mod:`lopd_jax.sweep`).

``python -m lopd_jax.sweep_report base-composer RUN_DIR`` evaluates the paper's
"Base + Composer" row of a composer run: theta0 conditioned on the run's final composer
(the LOPD one; the cold-start one for the frozen arm, whose composer is never updated),
greedy, on the run's own held-out evaluation tasks and caps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Any, Sequence

import jax
import numpy as np

from lopd_jax.io import files
from lopd_jax.programs.launcher import USER_ERROR_EXITS, exit_on_error
from lopd_jax.method import statistics
from lopd_jax.method.eval_stats import behaviour_stats
from lopd_jax.programs.arm_stats import arm_label, cluster_name, contrast_family, family_note, format_contrasts, ranking
from lopd_jax.programs.composer_eval import latent_context, load_composer_run
from lopd_jax.programs.eval_suite import sweep_suite_table
from lopd_jax.rollout.episodes import rollout

TABLE3 = (("tool_calls_per_step", "calls/step"), ("mean_env_steps", "env steps"),
          ("repeated_calls", "repeated calls"), ("first_response_tokens", "1st-response tokens"),
          ("reward_per_call", "reward/call"), ("mean_errors", "errors"))


def _read_json(path: str, default: Any = None) -> Any:
    """A JSON file (local or gs://), or ``default`` when it is absent."""
    if not files.exists(path):
        return default
    return json.loads(files.read_text(path))


def _metrics(workdir: str) -> list[dict]:
    path = files.join(workdir, "metrics.jsonl")
    if not files.exists(path):
        return []
    return [json.loads(x) for x in files.read_text(path).splitlines() if x.strip()]


def _numeric(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def collect(spec, root: str) -> dict[str, Any]:
    """One run's record: identity, rollouts, held-out before / after (and Base + Composer),
    stage times, the training curve and the held-out evaluations against rollouts."""
    wd = spec.workdir(root)
    ledger = _read_json(files.join(wd, "stages.json"), {})
    rows = _metrics(wd)
    by_step = {}
    for r in rows:
        if r.get("stage") == "lopd":
            by_step[int(r["step"])] = r  # a resumed run may repeat a step: the last record wins
    train = [by_step[s] for s in sorted(by_step)]
    cum = np.cumsum([float(r.get("rollouts", 0)) for r in train]).tolist()
    at = {0: 0.0, **{int(r["step"]): c for r, c in zip(train, cum)}}
    evals = sorted((at[int(r["step"])], float(r["reward_mean"]), float(r.get("success_rate", math.nan)))
                   for r in rows if r.get("stage") in ("eval_before", "eval", "eval_after")
                   and int(r["step"]) in at and "reward_mean" in r)
    secs = {k: v.get("seconds") for k, v in ledger.items() if isinstance(v, dict) and "seconds" in v}
    # rollouts per minute without the first step (whose rollout may include the sampler's compile)
    timed = train[1:] if len(train) > 1 else train
    rsec, rcount = (sum(float(r.get(k, 0)) for r in timed) for k in ("rollout_seconds", "rollouts"))
    bc = _read_json(files.join(wd, "base_composer.json"))
    per_task = ledger.get("eval_after", {}).get("per_task")
    suite = _read_json(files.join(wd, "suite", "report.json"))  # evaluate --suite --out_dir=<workdir>/suite
    return {
        "suite": None if suite is None else {r["benchmark"]: r.get("score") for r in suite.get("rows", [])},
        "arm": spec.arm, "seed": spec.seed, "name": spec.name, "grid": dict(spec.grid),
        "overrides": list(spec.overrides), "workdir": wd, "finished": bool(ledger.get("export", {}).get("done")),
        "steps": len(train), "rollouts": cum[-1] if cum else 0.0,
        "bank_rollouts": ledger.get("bank", {}).get("rollouts"),
        "before": _numeric(ledger.get("eval_before", {})), "after": _numeric(ledger.get("eval_after", {})),
        "per_task": per_task,
        "base_composer": None if bc is None else _numeric(bc),
        "seconds": secs,
        "shared_stages": [k for k, v in ledger.items() if isinstance(v, dict) and v.get("shared_from")],
        "rollouts_per_minute": 60.0 * rcount / rsec if rsec else None,
        "wall_seconds": sum(float(v or 0) for v in secs.values()),
        "curve": [{"rollouts": c, **{k: r.get(k) for k in ("reward_mean", "success_rate", "delta", "beta",
                                                             "distill_kl", "ratio_mean")}}
                  for r, c in zip(train, cum)],
        "evals": [{"rollouts": x, "reward_mean": y, "success_rate": s} for x, y, s in evals],
    }


def rollouts_to(record: dict, threshold: float) -> float | None:
    """Rollouts done at the first held-out evaluation reaching ``threshold`` (None: never)."""
    for e in record["evals"]:
        if e["reward_mean"] >= threshold:
            return e["rollouts"]
    return None


def _ms(xs: Sequence[float | None], fmt: str = "{:.3f}") -> str:
    xs = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return "-"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(np.mean(xs))} ± {fmt.format(np.std(xs, ddof=1))}"


def _groups(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["name"], []).append(r)
    return out


def default_threshold(records: list[dict]) -> float | None:
    """Halfway from the mean held-out reward before training to the best run group's mean
    final reward."""
    before = [r["before"].get("reward_mean") for r in records if r["before"]]
    finals = [np.mean([r["after"]["reward_mean"] for r in g]) for g in _groups(records).values()
              if all(r["after"] for r in g)]
    if not before or not finals:
        return None
    b = float(np.mean(before))
    return b + 0.5 * (max(finals) - b)


def contrasts(records: list[dict], resamples: int = statistics.RESAMPLES) -> str:
    """Every pair of run groups whose runs all kept per-task outcomes: the difference of
    final held-out reward with its 95% paired cluster-level t interval over the tasks' cluster
    keys (:func:`lopd_jax.method.statistics.cluster_t`; the cluster bootstrap beside it,
    ``resamples`` its resamples), Holm-corrected over the pairs of this table, and the
    ranking those intervals allow; "" with fewer than two such groups."""
    groups = {n: [{**r["per_task"], "seed": r["seed"]} for r in g]  # with its seed: runs pair by seed
              for n, g in _groups(records).items() if all(r.get("per_task") for r in g)}
    if len(groups) < 2:
        return ""
    names = list(groups)
    rows = contrast_family(groups, [(a, b) for i, a in enumerate(names) for b in names[i + 1:]],
                           resamples=resamples)
    first = next(iter(groups.values()))
    return (f"95% paired cluster-level t over the {cluster_name(first)} clusters of the held-out tasks (seeds "
            f"averaged within each cluster, their common shift added; docs/statistics.md); p two-sided, "
            f"{family_note(rows, 'pairs')}.\n\n{format_contrasts(rows)}\n\n"
            "Ranking (only where a corrected interval excludes 0):\n\n" + "\n".join(f"* {x}" for x in ranking(rows)))


def table(records: list[dict], threshold: float | None) -> str:
    """The markdown table over seeds (see the module docstring)."""
    head = ["run", "seeds", "held-out reward before", "held-out reward after", "success before", "success after",
            "rollouts", f"rollouts to {threshold:.3f}" if threshold is not None else "rollouts to threshold",
            *[label for _, label in TABLE3], "train wall s", "rollouts/min"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = _groups(records)
    base = [r["before"] for r in records if r["before"]]
    if base:
        lines.append("| " + " | ".join(["Base (theta0, before training)", str(len(base)),
                                         _ms([b["reward_mean"] for b in base]),
                                         "", _ms([b.get("success_rate") for b in base]), "", "", "",
                                         *[_ms([b.get(k) for b in base], "{:.2f}") for k, _ in TABLE3], "", ""]) + " |")
    for name, g in groups.items():
        done = [r for r in g if r["after"]]
        reach = [rollouts_to(r, threshold) for r in done] if threshold is not None else []
        hit = [x for x in reach if x is not None]
        reach_s = (f"{np.mean(hit):.0f} ({len(hit)}/{len(done)})" if hit else f"- (0/{len(done)})") \
            if threshold is not None else "-"
        lines.append("| " + " | ".join([
            arm_label(name), str(len(done)), _ms([r["before"].get("reward_mean") for r in done]),
            _ms([r["after"].get("reward_mean") for r in done]), _ms([r["before"].get("success_rate") for r in done]),
            _ms([r["after"].get("success_rate") for r in done]), _ms([r["rollouts"] for r in done], "{:.0f}"),
            reach_s, *[_ms([r["after"].get(k) for r in done], "{:.2f}") for k, _ in TABLE3],
            _ms([r["seconds"].get("lopd") for r in done], "{:.0f}"),
            _ms([r["rollouts_per_minute"] for r in done], "{:.0f}")]) + " |")
        bcs = [r["base_composer"] for r in done if r["base_composer"]]
        if bcs:
            lines.append("| " + " | ".join([
                f"{name}: Base + Composer", str(len(bcs)), "", _ms([b["reward_mean"] for b in bcs]), "",
                _ms([b.get("success_rate") for b in bcs]), "", "",
                *[_ms([b.get(k) for b in bcs], "{:.2f}") for k, _ in TABLE3], "", ""]) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- figures


def _plt():
    import matplotlib  # heavy: only the figures need it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use('Agg'): no display needed
    return plt


def fig_arms(records: list[dict], path: str) -> str:
    """Figure 3 (left): final held-out reward per run group, mean +- std over seeds,
    with the mean before training as a dashed line."""
    plt = _plt()
    groups = [(n, [r["after"]["reward_mean"] for r in g if r["after"]]) for n, g in _groups(records).items()]
    groups = [(n, v) for n, v in groups if v]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(groups) + 1.5), 3.6))
    x = np.arange(len(groups))
    ax.bar(x, [np.mean(v) for _, v in groups], yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for _, v in groups],
           color="tab:blue", alpha=0.8, capsize=4)
    for i, (_, v) in enumerate(groups):
        ax.scatter([i] * len(v), v, color="k", s=10, zorder=3)
    before = [r["before"]["reward_mean"] for r in records if r["before"]]
    if before:
        ax.axhline(np.mean(before), color="gray", ls="--", lw=1, label="before training")
        ax.legend(fontsize=8)
    ax.set_xticks(x, [n for n, _ in groups], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out reward (final)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fig_grid(records: list[dict], key: str, path: str, label: str | None = None) -> str:
    """Figure 3 (right) / Figure 5: final held-out reward against one grid field, one line
    per arm, mean +- std over seeds."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    for arm in dict.fromkeys(r["arm"] for r in records if key in r["grid"]):
        pts: dict[float, list[float]] = {}
        for r in records:
            if r["arm"] == arm and key in r["grid"] and r["after"]:
                pts.setdefault(float(r["grid"][key]), []).append(r["after"]["reward_mean"])
        xs = sorted(pts)
        m = np.array([np.mean(pts[v]) for v in xs])
        s = np.array([np.std(pts[v], ddof=1) if len(pts[v]) > 1 else 0.0 for v in xs])
        ax.errorbar(xs, m, yerr=s, marker="o", capsize=3, label=arm)
    ax.set_xlabel(label or key)
    ax.set_ylabel("held-out reward (final)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fig_curves(records: list[dict], path: str) -> str:
    """Figure 4: sampled-rollout reward, Delta and beta against rollouts, one line per run
    group (mean over seeds) with a +- std band; held-out evaluations as squares."""
    plt = _plt()
    keys = [("reward_mean", "reward (rollouts)"), ("delta", "Δ"), ("beta", "β")]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(6.4, 7.2))
    for i, (name, g) in enumerate(_groups(records).items()):
        color = f"C{i % 10}"
        for ax, (k, label) in zip(axes, keys):
            n = min((len(r["curve"]) for r in g), default=0)
            ys = np.array([[np.nan if c.get(k) is None else c[k] for c in r["curve"][:n]] for r in g], float)
            if not n or np.all(np.isnan(ys)):
                continue
            x = np.array([c["rollouts"] for c in g[0]["curve"][:n]])
            m = np.nanmean(ys, axis=0)
            ax.plot(x, m, color=color, lw=1.4, label=name if k == "reward_mean" else None)
            if len(g) > 1:
                sd = np.nanstd(ys, axis=0, ddof=1)
                ax.fill_between(x, m - sd, m + sd, color=color, alpha=0.2)
            ax.set_ylabel(label)
        ev: dict[float, list[float]] = {}
        for r in g:
            for e in r["evals"]:
                ev.setdefault(e["rollouts"], []).append(e["reward_mean"])
        if ev:
            xs = sorted(ev)
            axes[0].plot(xs, [np.mean(ev[x]) for x in xs], color=color, ls="--", marker="s", ms=4)
    axes[0].legend(fontsize=7, loc="best", title="solid: sampled, dashed: held-out", title_fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("rollouts (cumulative training trajectories)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


GRID_FIGURES = {"steps.margin": ("fig3_margin.png", "margin m"),
                "composer.num_latents": ("fig5_K.png", "K (latents per experience)"),
                "composer.n_ret": ("fig5_n_ret.png", "n_ret (retrieved experiences)")}


def write_report(root: str, specs, threshold: float | None = None) -> list[str]:
    """``results.json``, ``results.md`` and the figures of the runs ``specs``; returns the paths."""
    records = [collect(s, root) for s in specs]
    finished = [r for r in records if r["finished"]]
    thr = threshold if threshold is not None else default_threshold(finished)
    for r in records:
        r["rollouts_to_threshold"] = None if thr is None else rollouts_to(r, thr)
    out = [os.path.join(root, "results.json")]
    with open(out[0], "w") as f:
        json.dump({"threshold": thr, "records": records}, f, indent=2)
    md = os.path.join(root, "results.md")
    with open(md, "w") as f:
        f.write(f"# Sweep results ({len(finished)} finished runs of {len(records)})\n\n")
        f.write("Held-out reward: greedy, mean over the run's evaluation tasks; mean ± sample SD over seeds. "
                "Success: reward >= 1. Rollouts: training-stage rollouts (bank rollouts not counted). "
                "Rollouts to threshold: first held-out evaluation at or above it (seeds reaching it). "
                "Table-3 statistics after training.\n\n")
        f.write(table(finished, thr) + "\n")
        pairs = contrasts(finished)
        if pairs:
            f.write("\n## Contrasts\n\n" + pairs + "\n")
        suite_md = sweep_suite_table(finished)
        if suite_md:
            f.write("\n## Benchmark suite (Tables 1 and 2, 0-100)\n\n" + suite_md + "\n")
    out.append(md)
    if finished:
        out.append(fig_arms(finished, os.path.join(root, "fig3_arms.png")))
        if any(r["curve"] for r in finished):
            out.append(fig_curves(finished, os.path.join(root, "fig4_curves.png")))
        for key in dict.fromkeys(k for r in finished for k in r["grid"]):
            if len({r["grid"][key] for r in finished if key in r["grid"]}) < 2:
                continue  # an arm variant (one value), not a sweep of the field
            name, label = GRID_FIGURES.get(key, (f"fig_grid_{key.replace('.', '_')}.png", key))
            out.append(fig_grid(finished, key, os.path.join(root, name), label))
    return out


# ----------------------------------------------------------------------------- Base + Composer


def base_composer_eval(workdir: str) -> dict[str, Any]:
    """Greedy held-out evaluation of theta0 conditioned on the run's composer latents
    (the run's evaluation tasks, caps and batch); writes ``base_composer.json``."""

    run = load_composer_run(workdir, "auto")
    ctx, cfg = run.ctx, run.ctx.cfg
    greedy = dataclasses.replace(cfg.rollout.sampling, temperature=0.0)
    key = jax.random.fold_in(jax.random.key(cfg.seed), 1 << 21)
    B = cfg.env.tasks_per_step
    trajs = []
    for i in range(0, len(ctx.eval_tasks), B):
        tasks = ctx.eval_tasks[i:i + B]
        trajs += rollout(ctx.engine, run.base_params(), ctx.fmt, ctx.source.make_env, tasks,
                         jax.random.fold_in(key, i), cfg.rollout.caps, greedy,
                         latents=latent_context(run, tasks))
    stats = _numeric(behaviour_stats(trajs))
    stats["reward_mean"] = float(np.mean([t.reward for t in trajs]))
    stats.update(composer_stage=run.stage, composer_step=run.step)
    files.write_text(files.join(workdir, "base_composer.json"), json.dumps(stats, indent=2))  # local or gs://
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lopd_jax.sweep_report base-composer RUN_DIR``: the Base + Composer row of one run
    as JSON (a sweep's whole report is rebuilt with ``python -m lopd_jax.sweep --report_only``)."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.sweep_report",
                                description="The paper's Base + Composer row of one finished composer run "
                                            "(theta0 + the run's composer, greedy, its held-out tasks), written to "
                                            "RUN_DIR/base_composer.json and printed. A sweep's tables and figures: "
                                            "python -m lopd_jax.sweep --config=NAME --workdir=S --report_only.")
    p.add_argument("command", choices=["base-composer"])
    p.add_argument("run_dir", help="a run directory (local or gs://)")
    args = p.parse_args(argv)

    row, code = exit_on_error(USER_ERROR_EXITS, base_composer_eval, args.run_dir)
    if code is not None:
        return code
    print(json.dumps(row, indent=2))
    return 0

