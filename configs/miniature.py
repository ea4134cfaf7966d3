"""CPU miniature for comparing arms: the tiny default plus a warm-up that teaches the model
to read a privileged text context, so self-distillation has something to distil.

The tiny default's theta0 never saw a context block in its prompt, so an oracle hint there
does not help it (the premise of self-distillation fails; docs/miniature.md). Here the
supervised warm-up (the stand-in for pre-training) also shows every training task's oracle
demonstration once more with the task's oracle hint in the latent slot's place
(``stages.warmup_hint_fraction=1.0``, :mod:`lopd_jax.privileged`), and runs longer, so the
base policy solves some held-out tasks from the instruction alone and the teacher with the
hint solves more. See docs/miniature.md for the premise check and the measured comparison.
"""

import dataclasses

from configs.tiny import CONFIG as TINY

CONFIG = dataclasses.replace(
    TINY,
    rollout=dataclasses.replace(TINY.rollout, max_total_tokens=640),
    stages=dataclasses.replace(TINY.stages, warmup_steps=320, warmup_hint_fraction=1.0),
    workdir="workdirs/miniature",
)
