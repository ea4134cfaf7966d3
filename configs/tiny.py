"""CPU default: the tiny Qwen3-shaped backbone on the synthetic tool-use family.

Sized so a whole run (warm-up, cold start, LOPD, evaluation) takes minutes on two CPU
cores: a 2-layer, 64-wide model, 8 tasks per step, short episodes (tool schemas without
descriptions, at most 512 tokens), K = 4 latents from n_ret = 2 experiences, a few dozen
steps per stage. The model starts from random weights, so a supervised warm-up on the
family's reference solutions comes first; 160 steps teach it the tool-call format and
which tools each family needs, but not to copy names and numbers from the instruction,
so its held-out reward is near zero before and after LOPD (0.000 here, a few hundredths
elsewhere: the engine's batching, the device count and the CPU vary the last bits, see
docs/results.md, "The tiny run").
The run shows that every stage runs, resumes and exports, not that the method learns
(that is the miniature's job: configs/miniature.py, docs/miniature.md).
"""

from lopd_jax.method.composer import ComposerConfig
from lopd_jax.settings.config import (BankSection, CheckpointSection, EnvSection, ModelSection, RolloutSection,
                             StagesSection, TrainConfig)
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import EngineConfig, MeshConfig, RolloutConfig, StepConfig
from models.config import LoraConfig

CONFIG = TrainConfig(
    # 896 >= the tiny tokenizer's ids (BPE trained on the built-in corpus plus the training prompts,
    # about 890 with the chat and latent tokens; see train.run_context.domain_corpus). tokenizer=auto:
    # that tiny tokenizer for this tiny model, the checkpoint's own with model.hf_path=...
    model=ModelSection(name="tiny_qwen3", vocab_size=896, tokenizer="auto", dtype="float32",
                       param_dtype="float32", attention_impl="plain", remat_policy="none"),
    composer=ComposerConfig(num_latents=4, depth=2, n_ret=2, ff_mult=2,
                            lora=LoraConfig(rank=4, alpha=8.0, dropout=0.0), max_experience_tokens=256),
    # a random-init tiny model needs far larger steps than the paper's 1e-5 to move in minutes
    steps=StepConfig(loss=LossConfig(top_m=8, logits_chunk=128), student_lr=1e-3, composer_lr=1e-3, cold_start_lr=3e-3),
    mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
    bank=BankSection(embedder="hashing", embedder_dim=256, max_obs_chars=120),
    env=EnvSection(source="synthetic", kwargs={"n_train_per_family": 16, "n_heldout_per_family": 4, "seed": 0,
                                               "tool_descriptions": False},
                   tasks_per_step=8, group_size=1),
    rollout=RolloutSection(caps=RolloutConfig(max_env_steps=4, max_turn_tokens=96, max_total_tokens=512)),
    # 8 slots = one step's rollouts; 16-token pages keep the compiled page widths few (1..32 pages);
    # the synthetic environments answer in microseconds, so they run on the engine's thread; one
    # device in fp32: no sharded compiles on CPU, and samples exactly as the trainer's logits
    engine=EngineConfig(slots=8, page_size=16, num_pages=0, decode_chunk=8, prefill_chunk=128, max_in_flight=0,
                        env_workers=0, devices=1, tensor=1, dtype="float32"),
    # all 36 held-out tasks (4 per family) at every evaluation
    stages=StagesSection(warmup_steps=160, warmup_batch=8, warmup_lr=5e-3, cold_start_steps=30,
                         cold_start_batch=4, lopd_steps=24, eval_tasks=None, eval_every=8),
    checkpoint=CheckpointSection(every_steps=8, keep=2, async_save=True),
    seed=0,
    workdir="workdirs/tiny",
)
