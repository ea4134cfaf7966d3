"""The drifting miniature: configs/miniature.py with its hidden customer -> hub map changing
during LOPD, so the privileged context that helped before a drift can mislead after it and a
composer that keeps adapting has something to gain (docs/miniature.md, "The drifting variant").

Differences from configs/miniature.py, and why:

* ``drift_steps=(8,)``, ``drift_fraction=0.5``: half the customers (4 of 8) get a new hub
  at LOPD step 8 -- 8 steps on the old map, 8 on the new; the bank, built before LOPD,
  keeps the old map's successes, so retrieval surfaces stale hints for those customers;
* the schedule stays the miniature's: ``stages.schedule_scale=auto`` (η_β and the
  composer's learning rate x 50/16; docs/method.md, "Deviation: scaled schedule for short
  runs") is an option; on top of the miniature's composer lr (already 100x the paper's),
  in a 4-step run (x 12.5) it sent the shipped starting point's student to no tool calls
  within 2 steps.
"""

import dataclasses

from configs.miniature import CONFIG as MINIATURE

CONFIG = dataclasses.replace(
    MINIATURE,
    env=dataclasses.replace(MINIATURE.env, kwargs={**MINIATURE.env.kwargs, "drift_steps": [8],
                                                   "drift_fraction": 0.5}),
    workdir="workdirs/miniature_drift",
)
