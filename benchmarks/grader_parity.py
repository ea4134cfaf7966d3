"""Agreement of our LiveCodeBench and EvalPlus graders with upstream's own graders.

The corpus (``benchmarks/data/grader_parity``, our own programs in upstream's file
formats: LiveCodeBench release rows + ``[{"question_id", "code_list"}]`` samples, EvalPlus
release rows + ``{"task_id", "solution"}`` samples) is graded by
:mod:`lopd_jax.envs.code.livecodebench` / :mod:`lopd_jax.envs.code.evalplus` and by
upstream's code from checkouts you already have (nothing is downloaded, nothing copied):
LiveCodeBench's ``compute_code_generation_metrics.evaluate_generations_by_problem``
(timeout 6), and evalplus's ``untrusted_check`` on the base then the plus inputs (fast
check, default time limits) against ``trusted_exec`` ground truth, MBPP+ inputs through
its ``mbpp_deserialize_inputs``. A program agrees when the verdicts are equal (EvalPlus:
base and plus). ``--record`` writes upstream's verdicts to ``expected.json`` (the tests
check ours against it without upstream).

    python -m benchmarks.grader_parity --lcb=LiveCodeBench --evalplus=evalplus-0.3.1-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor

from lopd_jax.envs.code import evalplus as ours_ep
from lopd_jax.envs.code import livecodebench as ours_lcb_mod
from lopd_jax.envs.code.benchmark import grade_many, read_rows

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "grader_parity")


def load_corpus(data: str = DATA) -> dict:
    """The corpus: LiveCodeBench ``(question_id, idiom, code)`` and EvalPlus ``(task_id,
    idiom, solution)`` items, with the problem files' paths."""
    with open(os.path.join(data, "lcb_samples.json"), encoding="utf-8") as f:
        lcb = [(s["question_id"], idiom, code) for s in json.load(f)
               for idiom, code in zip(s["idioms"], s["code_list"])]
    ep = [(r["task_id"], r["idiom"], r["solution"])
          for _, r in read_rows(os.path.join(data, "evalplus_samples.jsonl"))]
    return {"lcb": lcb, "evalplus": ep, "lcb_problems": os.path.join(data, "lcb_problems.jsonl"),
            "evalplus_problems": os.path.join(data, "evalplus_problems.jsonl")}


def ours_lcb(corpus: dict, workers: int = 2) -> list[bool]:
    """Our LiveCodeBench verdicts (pass booleans), one per corpus program."""
    source = ours_lcb_mod.LiveCodeBenchTaskSource(corpus["lcb_problems"])
    tasks = {t.task_id: t.payload for t in source.all_tasks()}
    items = [(tasks[q], code) for q, _, code in corpus["lcb"]]
    return [r[0] == 1.0 for r in grade_many(ours_lcb_mod.grade, items, source.sandbox, workers,
                                            progress=False)]


def ours_evalplus(corpus: dict, workers: int = 2) -> list[list[bool]]:
    """Our EvalPlus verdicts (``[base, plus]``), one per corpus program."""
    source = ours_ep.EvalPlusTaskSource(corpus["evalplus_problems"])
    tasks = {t.task_id: t.payload for t in source.all_tasks()}
    items = [(tasks[t], code) for t, _, code in corpus["evalplus"]]
    return [[bool(r[3].get("base_passed")), bool(r[3].get("plus_passed"))]
            for r in grade_many(ours_ep.grade, items, source.sandbox, workers, progress=False)]


def expected_verdicts(data: str = DATA) -> dict:
    """Upstream's recorded verdicts: ``{"lcb" | "evalplus": {"<task id> <idiom>": verdict}}``."""
    with open(os.path.join(data, "expected.json"), encoding="utf-8") as f:
        return json.load(f)


def _lcb_samples(path: str) -> dict:
    out = {}
    for _, row in read_rows(path):
        tests = (json.loads(row["public_test_cases"])
                 + ours_lcb_mod.decode_private_tests(row["private_test_cases"], path))
        out[row["question_id"]] = {"input_output": json.dumps({
            "inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests],
            "fn_name": json.loads(row["metadata"]).get("func_name")})}
    return out


def upstream_lcb(corpus: dict, workers: int) -> list[bool]:
    """LiveCodeBench's verdicts: ``evaluate_generations_by_problem`` of the checkout on
    ``sys.path`` (timeout 6), a program passing when every result is > 0 (``pass_k_utils``)."""
    from lcb_runner.evaluation.compute_code_generation_metrics import evaluate_generations_by_problem
    samples = _lcb_samples(corpus["lcb_problems"])

    def one(item):
        results, _ = evaluate_generations_by_problem(([item[2]], samples[item[0]], False, 6))
        return all(r > 0 for r in results[0])
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, corpus["lcb"]))


def _evalplus_root(path: str) -> str:
    if zipfile.is_zipfile(path):
        root = tempfile.mkdtemp(prefix="evalplus_whl_")
        with zipfile.ZipFile(path) as z:
            z.extractall(root)
        return root
    return os.path.abspath(path)


def _deserializer(root: str):
    """``mbpp_deserialize_inputs`` from evalplus's ``data/mbpp.py``, taken alone (the
    module's other imports download data and are not needed here)."""
    with open(os.path.join(root, "evalplus", "data", "mbpp.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "mbpp_deserialize_inputs")
    namespace: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "evalplus/data/mbpp.py", "exec"), namespace)
    return namespace["mbpp_deserialize_inputs"]


def upstream_evalplus(corpus: dict, root: str) -> list[list[bool]]:
    """evalplus's verdicts (``[base, plus]``) from the unpacked package at ``root`` (on
    ``sys.path``)."""
    from evalplus.eval import PASS, untrusted_check
    from evalplus.eval._special_oracle import MBPP_OUTPUT_NOT_NONE_TASKS
    from evalplus.gen.util import trusted_exec
    deserialize = _deserializer(root)
    problems, truth = {}, {}
    for _, p in read_rows(corpus["evalplus_problems"]):
        dataset = "mbpp" if p["task_id"].startswith("Mbpp/") else "humaneval"
        if dataset == "mbpp":
            p["base_input"] = deserialize(p["task_id"], p["base_input"])
            p["plus_input"] = deserialize(p["task_id"], p["plus_input"])
        not_none = dataset == "mbpp" and p["entry_point"] in MBPP_OUTPUT_NOT_NONE_TASKS
        oracle = {}
        for part in ("base", "plus"):
            oracle[part], oracle[part + "_time"] = trusted_exec(
                p["prompt"] + p["canonical_solution"], p[part + "_input"], p["entry_point"],
                record_time=True, output_not_none=not_none)
        problems[p["task_id"]], truth[p["task_id"]] = (dataset, p), oracle
    out = []
    for task_id, _, solution in corpus["evalplus"]:
        dataset, p = problems[task_id]
        stats = [untrusted_check(dataset, solution, p[part + "_input"], p["entry_point"],
                                 expected=truth[task_id][part], atol=p["atol"],
                                 ref_time=truth[task_id][part + "_time"], fast_check=True)[0]
                 for part in ("base", "plus")]
        out.append([stats[0] == PASS, stats[0] == PASS and stats[1] == PASS])
    return out


def main(argv: list[str] | None = None) -> int:
    """Grade the corpus both ways and print ``graders: A/B verdicts agree``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lcb", dest="upstream_lcb", required=True,
                    help="a LiveCodeBench checkout (holds lcb_runner/)")
    ap.add_argument("--evalplus", dest="upstream_evalplus", required=True,
                    help="an evalplus wheel or unpacked package root")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="write upstream's verdicts to expected.json")
    args = ap.parse_args(argv)
    corpus = load_corpus(args.data)
    args.upstream_evalplus = _evalplus_root(args.upstream_evalplus)
    sys.path.insert(0, os.path.abspath(args.upstream_lcb))
    sys.path.insert(0, args.upstream_evalplus)
    # evalplus forks from this process: run it before any thread pool exists
    theirs = {"evalplus": upstream_evalplus(corpus, args.upstream_evalplus)}
    theirs["lcb"] = upstream_lcb(corpus, args.workers)
    mine = {"lcb": ours_lcb(corpus, args.workers), "evalplus": ours_evalplus(corpus, args.workers)}
    agree_total = n_total = 0
    for bench in ("lcb", "evalplus"):
        agree = 0
        for item, a, b in zip(corpus[bench], mine[bench], theirs[bench]):
            if a == b:
                agree += 1
            else:
                print(f"  differ {bench} {item[0]} {item[1]}: ours {a} upstream {b}")
        print(f"{bench}: {agree}/{len(corpus[bench])} verdicts agree")
        agree_total, n_total = agree_total + agree, n_total + len(corpus[bench])
    if args.record:
        record = {b: {f"{item[0]} {item[1]}": v for item, v in zip(corpus[b], theirs[b])}
                  for b in ("lcb", "evalplus")}
        with open(os.path.join(args.data, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    print(f"graders: {agree_total}/{n_total} verdicts agree")
    return 0 if agree_total == n_total else 1


if __name__ == "__main__":
    sys.exit(main())
