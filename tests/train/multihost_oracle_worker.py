"""One process of the multi-process ``oracle_arg_prob`` check in ``tests/train/test_oracle_scores.py``.

    python tests/train/multihost_oracle_worker.py ADDRESS NUM_PROCESSES PROCESS_ID OUT.json

Builds the test's context (the miniature config, 8 held-out tasks, 4 rows per chunk) on
the pod's mesh (its parameters global arrays over every process's devices) and scores the
first 6 held-out tasks (a full chunk of 4 and a padded one of 2) with
:func:`train.oracle_scores.oracle_argument_probs`; every process writes what it got to
``OUT.json.p<PROCESS_ID>``.
"""

import json
import sys

from train.distributed import initialize

initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from configs import load_config  # noqa: E402
from lopd_jax.settings.overrides import apply_overrides  # noqa: E402
from train.oracle_scores import oracle_argument_probs  # noqa: E402
from train.run_context import RunContext  # noqa: E402

OVERRIDES = ["stages.eval_tasks=8", "env.tasks_per_step=4"]  # the ``ctx`` fixture of test_oracle_scores


def main(out_path: str) -> None:
    ctx = RunContext(apply_overrides(load_config("miniature"), OVERRIDES))
    frozen, lora0, _ = ctx.system.initial_params()
    params = ctx.policy_params(lora0, frozen) if ctx.student_lora else ctx.policy_params(frozen, frozen)
    assert not jax.tree.leaves(params)[0].is_fully_addressable  # the params span both processes
    tasks = ctx.eval_tasks[:6]
    probs = oracle_argument_probs(ctx, params, tasks)
    with open(f"{out_path}.p{jax.process_index()}", "w") as f:
        json.dump({"processes": jax.process_count(), "devices": jax.device_count(),
                   "task_ids": [t.task_id for t in tasks], "probs": probs}, f)


if __name__ == "__main__":
    main(sys.argv[4])
