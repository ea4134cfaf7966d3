"""CPU miniature for comparing arms: one synthetic family with a hidden per-customer rule, and
a warm-up that teaches the tiny model to read that rule from a privileged text context but
not the rule itself -- so theta0 alone guesses, theta0 with the hint knows, and
self-distillation has something to transfer (docs/miniature.md).

The family is ``dispatch.ship`` ("Ship order 417 for alice." -> ``ship_order(customer, hub)``):
each of 8 customers must ship through its own hub (one of 4 one-token city names), a fixed
seeded map the instruction never states, shared by the training and held-out tasks. A
policy that does not know the map is right about 1 time in 4; the oracle hint (the exact
call) names the hub.

Premise (docs/miniature.md, seed 0, 64 held-out tasks, greedy): theta0 0.234 (it guesses the
hub), theta0 with the oracle text 1.000, theta0 with the cold-start composer's latents 0.594;
teacher-forced oracle-token log-prob -0.0359 without the hint, -0.0002 with it.

Differences from the tiny default (configs/tiny.py), and why (docs/miniature.md):

* the ``dispatch`` domain only: 64 training and 64 held-out tasks (same customers, unseen
  order numbers), one tool, short prompts; the tool result and the final answer name the
  hub, so every demonstration trains "copy the city token in the context" (without that
  the warm-up never learned to read the hint);
* a separate warm-up set (``env.kwargs.n_warmup_per_family=256``) whose hub is drawn at
  random per task, each shown plain and with its oracle hint in the latent slot's place
  (``stages.warmup_hint_fraction=1.0``): the hub can only be predicted from the hint, so
  the warm-up teaches "read the hint" (the in-context ability a pre-trained model brings)
  and theta0 does not know the training/held-out map;
* shorter sequences (``rollout.max_total_tokens=384``, 3 environment steps);
* the bank keeps successes only (reward 1.0), as the paper does;
* 1000 warm-up steps (the copy emerges abruptly after a few hundred; a larger variant's
  warm-up never got there in 850 steps, see the doc), 300 cold-start steps of 8;
* 16 training steps of 8 rollouts (128 rollouts per arm); held-out evaluation before,
  after, and every 4 training steps.
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
