"""The LOPD step a run config asks for, derived in one place for the trainer and the compile check.

:func:`step_spec` reads a :class:`lopd_jax.settings.config.TrainConfig` and returns the
:class:`StepSpec` that fixes the compiled LOPD step: backbone architecture and numerics
(attention kernel and blocks, remat, dtypes), composer, step hyperparameters (logits
chunk, micro-batching, top-M), mesh and sharding rules, and the batch shapes (global
trajectories per step, padded sequence length, experience length).
:class:`train.run_context.RunContext` builds its system from it, and
``python -m lopd_jax.compile_check --config=NAME`` compiles from it, so the compile check
measures exactly the step ``python -m lopd_jax.train --config=NAME`` runs.

:func:`splice_layout` gives the latent block's token layout (its length adds to the
teacher's sequence) from the run's tokenizer, and :func:`abstract_lopd_batch` the
shapes and dtypes of one LOPD batch (:func:`train.batches.lopd_batch`'s arrays).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.method.composer import ComposerConfig
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.settings.sections import MeshConfig, StepConfig
from models.config import ModelConfig

SEQ_MULTIPLE = 128
# With ``composer.max_experience_tokens=None`` (uncut, as the release) the trainer pads
# encoder inputs to the power-of-two bucket of each batch's longest and recompiles per
# bucket; an ahead-of-time compile needs one length, so it assumes this bucket.
UNCUT_EXP_LEN = 2048


def padded_seq_len(max_total_tokens: int) -> int:
    """The training sequence length: the total-token cap rounded up to a multiple of 128
    (one shape per stage, so every step reuses one compiled program)."""
    return -(-max_total_tokens // SEQ_MULTIPLE) * SEQ_MULTIPLE


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything that fixes the compiled LOPD step of a run (see the module docstring).

    ``batch`` is the global number of trajectories per step (``env.tasks_per_step *
    env.group_size``), ``seq`` the padded trajectory length, ``exp_len`` the tokens per
    retrieved experience (``composer.max_experience_tokens``).
    """

    model: ModelConfig
    composer: ComposerConfig
    steps: StepConfig
    mesh: MeshConfig
    batch: int
    seq: int
    exp_len: int


def step_spec(cfg) -> StepSpec:
    """The :class:`StepSpec` of run config ``cfg`` (a ``TrainConfig``)."""
    return StepSpec(model=cfg.model_config(), composer=cfg.composer, steps=cfg.steps, mesh=cfg.mesh,
                    batch=cfg.env.tasks_per_step * cfg.env.group_size,
                    seq=padded_seq_len(cfg.rollout.caps.max_total_tokens),
                    exp_len=cfg.composer.max_experience_tokens or UNCUT_EXP_LEN)


def splice_layout(cfg, family: str, tokenizer) -> tuple[Any, Any, SpliceLayout]:
    """``(chat format, latent block, SpliceLayout)`` of the run's tokenizer and chat family."""

    fmt = make_chat_format(family, tokenizer, enable_thinking=cfg.rollout.enable_thinking,
                           use_tokenizer_template=cfg.model.uses_checkpoint_template)
    block = fmt.framing_ids(cfg.composer.latent_framing())
    layout = SpliceLayout(tuple(block.before_ids), tuple(block.after_ids), block.num_slots, block.slot_id)
    return fmt, block, layout


def abstract_lopd_batch(spec: StepSpec) -> dict:
    """``jax.ShapeDtypeStruct`` s of one LOPD batch of ``spec`` (for ahead-of-time compiles)."""

    b, s, n, e = spec.batch, spec.seq, spec.composer.n_ret, spec.exp_len
    return {
        "tokens": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "attention_mask": jax.ShapeDtypeStruct((b, s), jnp.bool_),
        "loss_mask": jax.ShapeDtypeStruct((b, s), jnp.float32),
        "insert_at": jax.ShapeDtypeStruct((b,), jnp.int32),
        "exp_tokens": jax.ShapeDtypeStruct((b, n, e), jnp.int32),
        "exp_mask": jax.ShapeDtypeStruct((b, n, e), jnp.bool_),
        "rewards": jax.ShapeDtypeStruct((b,), jnp.float32),
        "old_logp": jax.ShapeDtypeStruct((b, s), jnp.float32),
    }


__all__ = ["SEQ_MULTIPLE", "UNCUT_EXP_LEN", "padded_seq_len", "StepSpec", "step_spec", "splice_layout", "abstract_lopd_batch"]
