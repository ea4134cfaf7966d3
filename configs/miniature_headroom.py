"""The headroom testbed: configs/miniature.py with the experience bank built without any
success of the customers of two hubs, so the composer-conditioned teacher starts without
what those customers need and only a composer that adapts can supply it
(docs/miniature.md, "8. The headroom testbed", pre-registered before any run).

Differences from configs/miniature.py, and why:

* ``bank.withhold_clusters``: the four customers whose hidden hub is Tokyo or Paris under
  the family's map (env seed 0: bob, erin -> Tokyo; carol, hugo -> Paris). Their rollouts
  are never admitted, so no bank entry names Tokyo or Paris: every experience retrieved for
  those customers names another customer's hub (Oslo or Berlin), and phi0's teacher fails
  them. The student still samples all four hubs (theta0's ``oracle_arg_prob`` is about 0.25
  on every customer), so sampled successes on those customers reach the LOPD step, and only
  an adapting composer can turn them into a teacher that names the right hub;
* the composer's learning rate and eta_beta keep the paper's ratio (1e-5 : 0.5) scaled by
  ``COMPOSER_SCALE``; the pre-registration fixes how that factor is chosen (on training
  tasks of a selection prefix, never on held-out tasks) and the grid passes the chosen
  pair as overrides.
"""

import dataclasses

from configs.miniature import CONFIG as MINIATURE

WITHHELD_HUBS = ("Tokyo", "Paris")
WITHHELD_CUSTOMERS = ("bob", "carol", "erin", "hugo")  # the customers of WITHHELD_HUBS (test_bank checks the map)
WITHHELD_CLUSTERS = tuple(f"dispatch.ship:customer={c}" for c in WITHHELD_CUSTOMERS)
PAPER_COMPOSER_LR, PAPER_ETA_BETA = 1e-5, 0.5
COMPOSER_SCALE = 10  # the smallest candidate of the selection; the selection's choice is passed as overrides

CONFIG = dataclasses.replace(
    MINIATURE,
    bank=dataclasses.replace(MINIATURE.bank, withhold_clusters=WITHHELD_CLUSTERS),
    steps=dataclasses.replace(MINIATURE.steps, composer_lr=PAPER_COMPOSER_LR * COMPOSER_SCALE,
                              eta_beta=PAPER_ETA_BETA * COMPOSER_SCALE),
    workdir="workdirs/miniature_headroom",
)
