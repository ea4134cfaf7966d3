"""CPU miniature for comparing arms: one synthetic family with a hidden per-customer rule, and
a warm-up that teaches the tiny model to read that rule from a privileged text context but
not the rule itself -- so theta0 alone guesses, theta0 with the hint knows, and
self-distillation has something to transfer.

Differences from configs/tiny.py, and why:

* the ``dispatch`` domain only, whose tool result and final answer name the hub, so every
  demonstration trains "copy the city token in the context";
* a separate warm-up set whose hub is drawn at random and shown with its oracle hint in the
  latent slot's place: the warm-up teaches "read the hint", not the map;
* shorter sequences, successes-only bank (as the paper), 1,000 warm-up steps (the copy
  emerges abruptly after a few hundred), 300 cold-start steps;
* 16 training steps of 8 rollouts, held-out evaluation every 4.

Measurements (the premise, the demo, the arms): docs/miniature.md.
"""

import dataclasses

from configs.tiny import CONFIG as TINY

CONFIG = dataclasses.replace(
    TINY,
    env=dataclasses.replace(TINY.env, kwargs={"n_train_per_family": 64, "n_heldout_per_family": 64, "seed": 0,
                                              "tool_descriptions": False, "families": ["dispatch"],
                                              "n_warmup_per_family": 256}),
    rollout=dataclasses.replace(TINY.rollout, caps=dataclasses.replace(TINY.rollout.caps, max_env_steps=3, max_total_tokens=384)),
    bank=dataclasses.replace(TINY.bank, min_reward=1.0),
    stages=dataclasses.replace(TINY.stages, warmup_steps=1000, warmup_hint_fraction=1.0, cold_start_steps=300,
                               cold_start_batch=8, lopd_steps=16, eval_every=4),
    workdir="workdirs/miniature",
)
