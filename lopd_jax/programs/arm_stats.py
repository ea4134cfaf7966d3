"""Arms compared from their runs' per-task held-out outcomes: what the demo, the sweep report,
the miniature benchmark and ``benchmarks.rank_arms`` print beside a mean.

A finished run's ledger (``stages.json``) keeps each held-out evaluation's per-task
outcomes (``per_task``: task ids, cluster keys, rewards; :func:`train.stage_loop.per_task_outcomes`).
:func:`outcome_matrix` lines the seeds of an arm up over the tasks they share and
:func:`contrast` gives the difference of two arms its interval: the paired cluster-level t
(:func:`lopd_jax.method.statistics.cluster_t`, the primary) with the cluster bootstrap
(:func:`lopd_jax.method.statistics.paired_bootstrap`) beside it as a secondary column.
"""

from __future__ import annotations

import json
import os
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from lopd_jax.method import statistics


def ledger_outcomes(ledger: Mapping[str, Any], stage: str = "eval_after") -> dict[str, list] | None:
    """The per-task outcomes ``stage`` recorded in a ledger dict (None: not finished, or run
    before per-task outcomes were kept)."""
    entry = ledger.get(stage) or {}
    return entry.get("per_task") if entry.get("done") else None


def run_outcomes(run_dir: str, stage: str = "eval_after") -> dict[str, list] | None:
    """:func:`ledger_outcomes` of the run in ``run_dir`` (None without a ledger), or with
    ``stage="eval@K"`` the held-out evaluation after training step K (``metrics.jsonl``;
    None if the run has not recorded it)."""
    if "@" in stage:
        name, _, step = stage.partition("@")
        if name != "eval" or not step.isdigit():
            raise ValueError(f"stage {stage!r}: an intermediate evaluation is eval@STEP (e.g. eval@24)")
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return None
        found = None
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.get("stage") == "eval" and row.get("step") == int(step) and row.get("per_task"):
                    found = row["per_task"]  # the last one: a resumed run may have evaluated the step again
        return found
    path = os.path.join(run_dir, "stages.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return ledger_outcomes(json.load(f), stage)


def change_outcomes(after: Mapping[str, list], before: Mapping[str, list]) -> dict[str, list]:
    """Per-task change from one evaluation of a run to a later one: each numeric outcome is
    ``after - before`` over the tasks both evaluated (in ``after``'s order; cluster keys kept)."""
    pos = {t: i for i, t in enumerate(before["task_id"])}
    idx = [(i, pos[t]) for i, t in enumerate(after["task_id"]) if t in pos]
    if not idx:
        raise ValueError("the two evaluations share no held-out task; compare evaluations of the same tasks")
    out: dict[str, list] = {"task_id": [after["task_id"][i] for i, _ in idx],
                            "cluster": [after["cluster"][i] for i, _ in idx]}
    for key, values in after.items():
        if key not in ("task_id", "cluster") and key in before:
            out[key] = [float(values[i]) - float(before[key][j]) for i, j in idx]
    return out


def select_clusters(outcomes: Mapping[str, list], keep: Collection[str] | None = None,
                    drop: Collection[str] = ()) -> dict[str, list]:
    """The per-task outcomes of the tasks whose cluster key is in ``keep`` (None: every
    cluster) and not in ``drop`` (e.g. the headroom testbed's withheld customers, or the
    others); a selection that leaves no task is an error naming the run's keys."""
    idx = [i for i, c in enumerate(outcomes["cluster"]) if (keep is None or c in keep) and c not in drop]
    if not idx:
        raise ValueError(f"no held-out task has a selected cluster key (the run's keys: "
                         f"{sorted(set(outcomes['cluster']))})")
    return {k: [v[i] for i in idx] if isinstance(v, list) and len(v) == len(outcomes["cluster"]) else v
            for k, v in outcomes.items()}


def outcome_matrix(runs: Sequence[Mapping[str, list]], tasks: Sequence[str] | None = None,
                   key: str = "reward") -> tuple[np.ndarray, list[str], list[str]]:
    """``[seeds, tasks]`` outcomes of ``runs`` (per-task dicts) over ``tasks`` (default: the
    first run's), with the task ids and their cluster keys. A run missing a task is an error."""
    if not runs:
        raise ValueError("no run to line up; finish at least one run with per-task outcomes")
    first = runs[0]
    tasks = list(first["task_id"] if tasks is None else tasks)
    cluster_of = dict(zip(first["task_id"], first["cluster"]))
    rows = []
    for r in runs:
        by_id = dict(zip(r["task_id"], r[key]))
        missing = [t for t in tasks if t not in by_id]
        if missing:
            raise ValueError(f"a run lacks {len(missing)} of the compared tasks (e.g. {missing[0]!r}); "
                             f"compare runs evaluated on the same held-out tasks")
        rows.append([float(by_id[t]) for t in tasks])
        cluster_of.update(zip(r["task_id"], r["cluster"]))
    return np.array(rows), tasks, [cluster_of[t] for t in tasks]


def contrast(a_runs: Sequence[Mapping[str, list]], b_runs: Sequence[Mapping[str, list]],
             key: str = "reward", **kwargs: Any) -> dict[str, Any]:
    """Mean(a) - mean(b) over the tasks both arms' runs share with its primary interval, the
    paired cluster-level t (:func:`lopd_jax.method.statistics.cluster_t`: ``estimate``, ``lo``,
    ``hi``, ``p_value``, ``df``, the design), and under ``bootstrap`` the paired cluster
    bootstrap's ``lo``, ``hi`` and ``p_value`` (``kwargs``: ``paired_seeds``, ``level``, and the
    bootstrap's ``resamples`` and ``seed``). Runs that carry
    their ``seed`` are paired by seed, and only when both arms ran the same seeds (an arm
    with a run missing is compared unpaired); runs without one are paired by position when
    both arms have as many. Runs that carry a ``prefix`` (the warm-up seed their theta0, bank
    and phi0 came from) are compared within prefix: see :func:`prefix_means`."""
    prefixes = {r.get("prefix") for r in [*a_runs, *b_runs]}
    if len(prefixes) > 1:
        a_runs, b_runs, design = prefix_means(a_runs, b_runs, key)
        out = contrast(a_runs, b_runs, key, **kwargs)
        return {**out, **design}
    if "paired_seeds" not in kwargs and all("seed" in r for r in [*a_runs, *b_runs]):
        a_runs, b_runs = (sorted(runs, key=lambda r: r["seed"]) for runs in (a_runs, b_runs))
        kwargs["paired_seeds"] = [r["seed"] for r in a_runs] == [r["seed"] for r in b_runs]
    shared = [t for t in a_runs[0]["task_id"] if all(t in set(r["task_id"]) for r in [*a_runs, *b_runs])]
    a, tasks, clusters = outcome_matrix(a_runs, shared, key)
    b, _, _ = outcome_matrix(b_runs, shared, key)
    t_kwargs = {k: v for k, v in kwargs.items() if k in ("paired_seeds", "level")}
    out = statistics.cluster_t(a, b, clusters, **t_kwargs)
    boot = statistics.paired_bootstrap(a, b, clusters, **kwargs)
    out["bootstrap"] = {k: boot[k] for k in ("lo", "hi", "p_value", "resamples")}
    # of the per-task differences (seeds averaged): how many independent tasks the contrast is worth
    out["effective_sample_size"] = statistics.effective_sample_size(a.mean(0) - b.mean(0), clusters)
    return out


def prefix_means(a_runs: Sequence[Mapping[str, list]], b_runs: Sequence[Mapping[str, list]],
                 key: str = "reward") -> tuple[list[dict], list[dict], dict[str, Any]]:
    """Each arm's runs averaged within prefix, over the prefixes both arms ran: one row per
    prefix (the run unit of the contrast; docs/statistics.md, "Several prefixes").

    A prefix (``run["prefix"]``) fixes theta0, the bank and phi0, so runs of one prefix share
    its draw and are not independent of each other; runs of different prefixes are never
    paired. Within a prefix the arms' seeds are averaged (the difference of the seed means is
    the within-prefix contrast whether or not the seeds pair); the prefix means are then paired
    by prefix. A run without a ``prefix`` among prefixed runs is an error; a prefix only one
    arm ran is left out and named under ``prefixes_dropped``. Returns the two arms' rows
    (``task_id``, ``cluster``, ``key``, and the prefix as ``seed``, the pairing key) and the
    design (``prefixes``, ``runs``, ``prefixes_dropped``)."""
    if any(r.get("prefix") is None for r in [*a_runs, *b_runs]):
        raise ValueError("some runs carry a prefix and some do not; compare runs of one layout "
                         "(rerun benchmarks.miniature_core with --prefix_seeds for every arm)")
    pa, pb = ({r["prefix"] for r in runs} for runs in (a_runs, b_runs))
    shared = sorted(pa & pb)
    if not shared:
        raise ValueError(f"the arms ran no prefix in common (a: {sorted(pa)}, b: {sorted(pb)}); runs of "
                         f"different prefixes are never paired: finish both arms on the same --prefix_seeds")
    tasks = [t for t in a_runs[0]["task_id"] if all(t in set(r["task_id"]) for r in [*a_runs, *b_runs])]
    rows: tuple[list[dict], list[dict]] = ([], [])
    for p in shared:
        for runs, out in zip((a_runs, b_runs), rows):
            m, _, clusters = outcome_matrix([r for r in runs if r["prefix"] == p], tasks, key)
            out.append({"task_id": tasks, "cluster": clusters, key: m.mean(0).tolist(), "seed": p})
    design = {"prefixes": len(shared), "runs": (sum(r["prefix"] in shared for r in a_runs),
                                                sum(r["prefix"] in shared for r in b_runs)),
              "prefixes_dropped": sorted((pa | pb) - set(shared))}
    return rows[0], rows[1], design


def cluster_name(runs: Sequence[Mapping[str, list]]) -> str:
    """What the runs' cluster keys are, in words: the hidden rule's key for ``family:key=value``
    keys (``customer``), ``task`` when each task is its own cluster."""
    r = runs[0]
    names = sorted({str(c).rsplit(":", 1)[1].split("=", 1)[0] for c in r["cluster"] if "=" in str(c)})
    if names:
        return "/".join(names)
    return "task" if list(r["cluster"]) == list(r["task_id"]) else "cluster"


def verdict(c: Mapping[str, Any]) -> str:
    """Whether the interval excludes 0, in words."""
    if c["lo"] > 0:
        return "the interval excludes 0 (a gain)"
    if c["hi"] < 0:
        return "the interval excludes 0 (a loss)"
    return "the interval includes 0 (no difference shown)"


def contrast_family(arms: Mapping[str, Sequence[Mapping[str, list]]], pairs: Sequence[tuple[str, str]],
                    key: str = "reward", **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`contrast` of each ``(a, b)`` in ``pairs`` whose arms both have runs (``arms``: name
    -> its seeds' per-task outcomes), with Holm-adjusted p-values over the family
    (``p_holm``) and ``significant`` (adjusted p < 1 - level: the family-wise interval
    excludes 0). Pairs with an arm missing come back with ``missing`` set."""
    out = []
    for a, b in pairs:
        missing = [n for n in (a, b) if not arms.get(n)]
        row: dict[str, Any] = {"a": a, "b": b, "missing": missing}
        if not missing:
            row.update(contrast(arms[a], arms[b], key, **kwargs))
        out.append(row)
    done = [r for r in out if not r["missing"]]
    for r, p in zip(done, statistics.holm([r["p_value"] for r in done])):
        r["p_holm"] = p
        r["significant"] = bool(p < 1.0 - r["level"])
    return out


def arm_label(arm: str) -> str:
    """An arm's name in a table: OPSD's teacher is handed the oracle call as its hint, so
    its rows read as an upper bound, not as a peer."""
    return f"{arm} (oracle hint, upper bound)" if arm.split("_")[0].split("__")[0] == "opsd" else arm


def family_note(rows: Sequence[Mapping[str, Any]], what: str = "contrasts") -> str:
    """The multiplicity family of a table, in words."""
    return (f"Holm over the {sum(1 for r in rows if not r['missing'])} {what} of this table "
            f"(a family of its own: not adjusted across tables or grids)")


def format_contrasts(rows: Sequence[Mapping[str, Any]], unit: str = "reward") -> str:
    """The contrasts as a Markdown table: estimate [95% cluster t CI], raw and Holm p, df, the
    design, and the cluster bootstrap's interval (secondary; under-covers at ~8 clusters)."""
    lines = [f"| contrast | Δ {unit} [95% CI, cluster t] | p | p (Holm) | df | seeds | tasks (clusters, Kish n_eff) "
             f"| cluster bootstrap 95% CI (secondary) | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"{arm_label(r['a'])} − {arm_label(r['b'])}"
        if r["missing"]:
            lines.append(f"| {name} | - | - | - | - | - | - | - | no finished run of {', '.join(r['missing'])} |")
            continue
        ess = r["effective_sample_size"]
        v = ("excludes 0 after Holm" if r["significant"] else
             "includes 0 after Holm" if r["lo"] <= 0 <= r["hi"] else "excludes 0 alone, not after Holm")
        boot = r.get("bootstrap")
        boot_ci = f"[{boot['lo']:+.4f}, {boot['hi']:+.4f}]" if boot else "-"
        lines.append(f"| {name} | {statistics.format_interval(r)} | {format_p(r['p_value'])} | "
                     f"{format_p(r['p_holm'])} | {r['df']} | {_runs_cell(r)} | "
                     f"{r['tasks']} ({r['clusters']}, {ess['n_eff']:.1f}) | {boot_ci} | {v} |")
    return "\n".join(lines)


def _runs_cell(r: Mapping[str, Any]) -> str:
    """The seeds column: runs per arm, and the prefixes they were averaged within."""
    if "prefixes" in r:
        return f"{r['runs'][0]} vs {r['runs'][1]} in {r['prefixes']} prefixes"
    return f"{r['seeds'][0]} vs {r['seeds'][1]}{'' if r.get('paired_seeds', True) else ' (unpaired)'}"


def format_p(p: float) -> str:
    """A p-value with four decimals, or "< 1e-04" below that."""
    return "< 1e-04" if p < 1e-4 else f"{p:.4f}"


def ranking(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Ordered statements only where a Holm-corrected contrast excludes 0 (``a > b``); the
    pairs whose interval includes 0 are named as not ranked."""
    out = []
    for r in rows:
        if r["missing"]:
            continue
        a, b = arm_label(r["a"]), arm_label(r["b"])
        if r["significant"]:
            hi, lo = (a, b) if r["estimate"] > 0 else (b, a)
            out.append(f"{hi} > {lo} ({statistics.format_interval(r)}, Holm p {format_p(r['p_holm'])})")
        else:
            out.append(f"{a} vs {b}: not ranked (Holm-corrected interval includes 0)")
    return out
