"""Per-customer view of the miniature's final students: which customers' hubs each learned.

    python -m benchmarks.miniature_hubs --workdir=W [--samples=3]

For every finished run ``W/runs/ARM_sSEED`` (benchmarks/miniature_core.py) this evaluates
the exported student on the held-out tasks of ``--config=miniature``'s task source with
:func:`lopd_jax.programs.evaluate.evaluate`: once greedy (the table's number, broken down by
customer) and ``--samples`` times at temperature 1 (no top-p / top-k), whose mean success
estimates the student's mean probability of a correct episode -- a finer measure than
greedy decoding, which is all-or-nothing per customer on this family. Writes
``W/hubs.json`` and prints a Markdown table per arm (mean +- std over seeds).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    from lopd_jax.io.startup import configure_platform

    configure_platform()  # before JAX is imported: no libtpu detection noise on CPU hosts
    from configs.miniature import CONFIG
    from lopd_jax.envs.synthetic.env import SyntheticTaskSource
    from lopd_jax.programs.evaluate import evaluate, parse_args

    p = argparse.ArgumentParser(prog="python -m benchmarks.miniature_hubs", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--samples", type=int, default=3)
    args = p.parse_args(argv)
    kwargs = dict(CONFIG.env.kwargs)
    src = SyntheticTaskSource(**kwargs)
    rule = src.hidden_rule("dispatch.ship")
    customer = {t.task_id: t.payload["params"]["customer"] for t in src.tasks("heldout")}
    r = CONFIG.rollout.caps
    runs = sorted(d for d in os.listdir(os.path.join(args.workdir, "runs"))
                  if os.path.isdir(os.path.join(args.workdir, "runs", d, "export")))
    out = {"rule": rule, "runs": {}}
    for name in runs:
        base = ["--model", os.path.join(args.workdir, "runs", name, "export"), "--env=synthetic",
                "--env_kwargs", json.dumps(kwargs), f"--max_steps={r.max_env_steps}",
                f"--max_turn_tokens={r.max_turn_tokens}", f"--max_total_tokens={r.max_total_tokens}", "--batch_size=64"]
        greedy = evaluate(parse_args(base + ["--temperature=0"]))
        by_customer = collections.defaultdict(list)
        for row in greedy["trajectories"]:
            by_customer[customer[row["task_id"]]].append(row["reward"])
        sampled = [evaluate(parse_args(base + ["--temperature=1", "--top_p=1", "--top_k=0", f"--seed={s}"]))
                   ["metrics"]["mean_reward"] for s in range(args.samples)]
        out["runs"][name] = {"greedy": greedy["metrics"]["mean_reward"],
                             "customers_right_greedy": sorted(c for c, v in by_customer.items() if min(v) == 1.0),
                             "sampled": float(np.mean(sampled)), "sampled_each": sampled}
        print(name, json.dumps(out["runs"][name]), flush=True)
    with open(os.path.join(args.workdir, "hubs.json"), "w") as f:
        json.dump(out, f, indent=1)
    arms = collections.defaultdict(list)
    for name, rec in out["runs"].items():
        arms[name.rsplit("_s", 1)[0]].append(rec)
    print("| arm | seeds | greedy held-out reward | customers right (greedy, of 8) | sampled held-out reward (T=1) |")
    print("|---|---|---|---|---|")
    for arm, recs in arms.items():
        f = lambda xs: f"{np.mean(xs):.4f} ± {np.std(xs):.4f}"  # noqa: E731
        print(f"| {arm} | {len(recs)} | {f([x['greedy'] for x in recs])} | "
              f"{f([len(x['customers_right_greedy']) for x in recs])} | {f([x['sampled'] for x in recs])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
