"""SmolLM2 sized for a table of arms: configs/smollm2_miniature.py with a held-out set that
can carry an interval and a training budget of 128 rollouts per arm (docs/smollm2.md,
"A table of arms").

Differences from configs/smollm2_miniature.py, and why:

* 64 held-out tasks, 8 per customer (``env.kwargs.balance_heldout``): the miniature's 16
  fall on the 8 customers as 3,3,3,3,1,1,1,1, so four customers carry 75% of the score and
  the effective sample is about 6 tasks; the training tasks, the warm-up tasks and the hidden
  map are unchanged, so the prefix (warm-up, bank, cold start) is the miniature's;
* 32 LOPD steps of 4 rollouts: 128 training rollouts per arm (GRPO: 2 tasks x G = 2);
* the held-out evaluation only before and after the steps (64 greedy episodes take about
  4 minutes of the 2-core CPU).
"""

import dataclasses

from configs.smollm2_miniature import CONFIG as SMOLLM2

CONFIG = dataclasses.replace(
    SMOLLM2,
    env=dataclasses.replace(SMOLLM2.env, kwargs={**SMOLLM2.env.kwargs, "n_heldout_per_family": 64,
                                                 "balance_heldout": True}),
    stages=dataclasses.replace(SMOLLM2.stages, lopd_steps=32, eval_tasks=64, eval_every=32),
    workdir="workdirs/smollm2_table",
)
