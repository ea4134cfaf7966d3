"""Shared pieces of the full-size configs: the paper's hyperparameters (docs/method.md, "Defaults")
and the TPU memory layout the compile check measured to fit (docs/results.md, "Compile check"):
FSDP over the slice with 4-way tensor parallelism, full remat, Pallas splash attention (block 512), logits chunk 1024,
one trajectory per chip per micro-step (``steps.micro_batch=1``), fp32 master weights
(bf16 compute). Each named config fills in its backbone and, where needed, its mesh.
Splash attention is a TPU kernel: on CPU override ``model.attention_impl=blockwise``.
Where the paper and the authors' release differ, these configs follow the release
(docs/release_parity.md lists every such setting, its field and the alternative).
"""

from lopd_jax.method.composer import ComposerConfig
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.core.defaults import MARGIN, TOP_M
from lopd_jax.settings.config import (BankSection, CheckpointSection, EnvSection, ModelSection, RolloutSection,
                             StagesSection, TrainConfig)
from lopd_jax.settings.length_config import LengthConfig
from lopd_jax.settings.sections import EngineConfig, MeshConfig, RolloutConfig, SamplingParams, StepConfig
from models.config import LoraConfig


def paper_config(name: str, *, source: str = "envscaler", workdir: str,
                 mesh: MeshConfig = MeshConfig(data=1, fsdp=-1, tensor=4), num_pages: int = 10_240) -> TrainConfig:
    """LOPD at paper settings on backbone ``name``.

    ``mesh``: the trainer's; by default FSDP with 4-way tensor parallelism (a host's 4 chips).
    On v5p-32 that makes 4 batch shards of 8 trajectories instead of 16 of 2, so packed rows
    are 92% real tokens instead of 49%, and the LOPD step's estimate falls from 11.7 s to 7.2 s
    with every collective priced and none overlapped (docs/packing.md, "The mesh").

    ``num_pages``: the engine's page pool per host (the default: the sizing rule's for
    v5p-32, ``python -m lopd_jax.compile_sampler --config=qwen3_8b --pool=rule``; a model
    whose pool would not fit in HBM passes the largest that does).

    Set ``model.hf_path`` to the Hugging Face checkpoint (local or gs://) for a real run;
    without it the architecture is built with random weights (compile checks). Task files
    go in ``env.kwargs``; for EnvScaler, in the layout docs/data.md gives
    (``env.kwargs.train_path=data/envscaler/train.jsonl``, ``heldout_path``, ``env_items_path``).
    """
    return TrainConfig(
        # fp32 parameters: AdamW steps of lr 1e-5 vanish below bf16 resolution
        model=ModelSection(name=name, tokenizer="auto", dtype="bfloat16", param_dtype="float32",
                           attention_impl="splash", attention_block_q=512, attention_block_kv=512,
                           remat_policy="full"),
        # the release: experience inputs uncut, feed-forward without bias
        composer=ComposerConfig(num_latents=32, depth=8, n_ret=3, ff_mult=4,
                                lora=LoraConfig(rank=8, alpha=16.0, dropout=0.0), max_experience_tokens=None,
                                ff_bias=False),
        steps=StepConfig(loss=LossConfig(margin=MARGIN, anchor_weight=0.2, top_m=TOP_M, logits_chunk=1024,
                                         composer_kl_weighting="rollout_mean", composer_margin_weighting="rollout_mean",
                                         logits_dtype="float32"),
                         eta_beta=0.5, micro_batch=1, student_lr=1e-5, composer_lr=1e-5, student_clip=1.0,
                         composer_clip=1.0, cold_start_lr=1e-5, cold_start_encoder_clip=3.0,
                         cold_start_compressor_clip=30.0, weight_decay=0.01, skip_nonfinite=True,
                         max_nonfinite_skips=10),
        mesh=mesh,
        # the release admits rollouts with reward >= 0.8; its Base + Composer inference retrieves 1
        bank=BankSection(min_reward=0.8, retrieval_mode="symmetric", allow_self_retrieval=True,
                         missing_hits="mask", eval_n_ret=1, embedder_pool_token="<|endoftext|>"),
        env=EnvSection(source=source, tasks_per_step=32, group_size=1),
        # the release: up to 10,000 new tokens per turn with Qwen3 thinking on (paper Table 3:
        # first turns of 6,000-10,000 tokens), 40,960 in total
        rollout=RolloutSection(sampling=SamplingParams(temperature=0.7, top_p=0.95, top_k=20),
                               caps=RolloutConfig(max_env_steps=30, max_turn_tokens=10_000, max_total_tokens=40_960),
                               enable_thinking=True),
        # the rollout engine per host of v5p-32 (4 hosts x 4 chips): 64 slots each (256 in all),
        # 128-token pages, 16 decode steps per call, on all 4 of the host's chips in bf16, tensor
        # parallel as wide as they and the KV heads allow (4); the pool from the sizing rule
        # (1.25 x the simulated p99 of live tokens + a page per episode in flight: 40,953 pages
        # over the slice, 10,240 per host: 45.0 GiB per chip for Qwen3-8B, 50.7 with the weights
        # and the trainer's params, of 95)
        engine=EngineConfig(slots=64, page_size=128, num_pages=num_pages, decode_chunk=16, prefill_chunk=512,
                            max_in_flight=0, env_workers=16, devices=0, tensor=0, dtype="bfloat16"),
        # 1,600 rollouts at B = 32 is the paper's horizon
        # (docs/method.md, "The paper's horizon and targets")
        stages=StagesSection(warmup_steps=0, cold_start_steps=1000, cold_start_batch=8, lopd_steps=50,
                             eval_tasks=None, eval_every=10),
        checkpoint=CheckpointSection(every_steps=10, keep=3, async_save=True),
        # packed rows (docs/packing.md): whole trajectories back to back in rows of these
        # lengths, each with its own segment, positions and latent block; on v5p-32 (4 batch
        # shards of 8 trajectories) 92% of row tokens are real, against 20% padded to 40,960
        lengths=LengthConfig(buckets=(8192, 16384, 24576, 32768), packing=True),
        seed=0,
        workdir=workdir,
    )
