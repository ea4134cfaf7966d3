"""The wide miniature: configs/miniature.py's hidden customer -> hub rule over 64 customers
instead of 8 (the ``fleet.ship`` family), for arm comparisons whose intervals can narrow
(docs/miniature.md, "The wide variant").

On the 8-customer family the held-out tasks fall on 8 clusters (Kish n_eff about 7): the
customers, not the seeds, carry an arm comparison's variance, so more seeds do not narrow
its interval. Differences from configs/miniature.py, and why:

* the ``fleet`` domain (64 customers, the same 4 hubs and tool) instead of ``dispatch``;
* 128 training and 128 held-out tasks (held-out: 55 customers, 1-5 tasks each), so a
  customer's share of the held-out score is about 1/55 instead of 1/8.

Everything else (model, warm-up, steps, learning rates) is the miniature's: the warm-up
draws each task's hub at random, so it teaches reading the hint, not the map.
"""

import dataclasses

from configs.miniature import CONFIG as MINIATURE

CONFIG = dataclasses.replace(
    MINIATURE,
    env=dataclasses.replace(MINIATURE.env, kwargs={**MINIATURE.env.kwargs, "families": ["fleet"],
                                                   "n_train_per_family": 128, "n_heldout_per_family": 128}),
    workdir="workdirs/miniature_wide",
)
