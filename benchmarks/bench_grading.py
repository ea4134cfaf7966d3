"""Grading time per HumanEval sample: out-of-sandbox verdict vs the legacy in-sandbox check.

Baseline (measured in the same run, same sandbox configuration): the legacy grader - one
sandboxed program holding the prompt, the model's code, the problem's ``check`` and a
random pass marker printed at the end (what ``code_grading`` did before the verdict moved
out of the sandbox). New: :func:`lopd_jax.envs.code.grading.evaluate_code` - the sandbox
runs the code on the test inputs only, the trusted checker worker runs ``check``. Both
grade the canonical solutions; samples alternate baseline / new per problem so load drift
hits both alike. "cold" clears the per-problem cache of collected test calls before each
sample (the first time a problem is graded); "warm" keeps it (every later sample of the
problem, e.g. the rest of a GRPO group).

    python -m benchmarks.bench_grading --n 40
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time

from lopd_jax.envs.code import grading as code_grading  # noqa: E402
from lopd_jax.envs.code.env import HumanEvalTaskSource, extract_code, reference_answer  # noqa: E402
from lopd_jax.envs.code.sandbox import run_python  # noqa: E402


def legacy_grade(payload: dict, code: str, config) -> float:
    """The legacy in-sandbox check program with a pass marker (the baseline)."""
    marker = "LOPD_ALL_TESTS_PASSED_" + secrets.token_hex(8)
    program = (f"{code_grading.humaneval_body(payload, code)}\n\n{payload['test']}\n\n"
               f"check({payload['entry_point']})\nprint({marker!r})\n")
    result = run_python(program, config=config)
    return 1.0 if result.status == "ok" and marker in result.stdout else 0.0


def main() -> None:
    """Time both graders on the first ``--n`` canonical solutions and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40, help="problems to grade (max 164)")
    args = ap.parse_args()
    source = HumanEvalTaskSource()
    tasks = source.all_tasks()[: args.n]
    cfg = source.sandbox
    code_grading.evaluate_code(tasks[0].payload, extract_code(
        reference_answer(tasks[0]), tasks[0].payload["entry_point"]), cfg)  # start the checker
    base, warm, cold, passed = [], [], [], [0, 0, 0]
    for task in tasks:
        code = extract_code(reference_answer(task), task.payload["entry_point"])
        t0 = time.perf_counter()
        passed[0] += legacy_grade(task.payload, code, cfg)
        t1 = time.perf_counter()
        code_grading._collected.clear()
        passed[1] += code_grading.evaluate_code(task.payload, code, cfg)[0]
        t2 = time.perf_counter()
        passed[2] += code_grading.evaluate_code(task.payload, code, cfg)[0]
        t3 = time.perf_counter()
        base.append(t1 - t0)
        cold.append(t2 - t1)
        warm.append(t3 - t2)
    n = len(tasks)
    print(f"HumanEval canonical solutions graded: {n} problems; passed legacy "
          f"{passed[0]:.0f}/{n}, new cold {passed[1]:.0f}/{n}, new warm {passed[2]:.0f}/{n}")
    print(f"enforced: {run_python('pass', config=cfg).enforced}")
    for name, xs in (("legacy in-sandbox check (baseline)", base),
                     ("new, cold (collect pass + sandbox + check)", cold),
                     ("new, warm (sandbox + check)", warm)):
        print(f"{name:45s} mean {statistics.mean(xs) * 1e3:7.1f} ms   "
              f"median {statistics.median(xs) * 1e3:7.1f} ms")
    print(f"ratio new/baseline (mean): warm {statistics.mean(warm) / statistics.mean(base):.2f}x"
          f", cold {statistics.mean(cold) / statistics.mean(base):.2f}x")
    print(f"ratio new/baseline (median): warm "
          f"{statistics.median(warm) / statistics.median(base):.2f}x, cold "
          f"{statistics.median(cold) / statistics.median(base):.2f}x")


if __name__ == "__main__":
    main()
