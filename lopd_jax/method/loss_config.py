"""The loss settings of the method: one frozen :class:`LossConfig` the losses
(:mod:`lopd_jax.method.losses`) and the training steps take whole.

The run config's ``steps`` section (:class:`lopd_jax.settings.sections.StepConfig`) holds one
inline, so its keys read ``steps.margin``, ``steps.logits_chunk``, ...; docs/method.md
explains the terms.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from lopd_jax.core.defaults import LOGITS_CHUNK, MARGIN, TOP_M

__all__ = ["COMPOSER_KL_WEIGHTINGS", "COMPOSER_MARGIN_WEIGHTINGS", "IS_CORRECTIONS", "LOGITS_DTYPES", "LossConfig"]

COMPOSER_KL_WEIGHTINGS = ("token_mean", "rollout_mean")
COMPOSER_MARGIN_WEIGHTINGS = ("rollout_mean", "token_mean")
LOGITS_DTYPES = ("float32", "compute")
IS_CORRECTIONS = ("none", "tis", "mis")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The LOPD objective's terms and numerics, and GRPO's clip.

    ``margin`` m and ``anchor_weight`` lambda of L = KL + beta (m - Delta) + lambda anchor;
    ``top_m``: the teacher's top-M tokens of the reverse KL. ``composer_kl_weighting`` /
    ``composer_margin_weighting``: how the composer's KL gradient and margin Delta average
    over tokens (``token_mean``) or rollouts (``rollout_mean``, the release); the dual step
    always uses the token-weighted Delta. ``logits_chunk``: sequence positions per LM-head
    chunk; ``logits_dtype``: ``float32`` (the release: the LM-head matmul accumulates and
    returns fp32) or ``compute`` (logits rounded to the compute dtype first).
    ``grpo_clip_eps``: the PPO-clip epsilon of the GRPO baseline.
    ``is_correction``: the importance correction for samples drawn by an older student
    (:mod:`lopd_jax.method.importance`; docs/method.md, "Importance correction for stale
    samples"): ``none`` (the on-policy losses as they are), ``tis`` (weights truncated at
    ``is_cap``) or ``mis`` (samples whose ratio leaves [1 / ``is_cap``, ``is_cap``] drop out).
    """

    margin: float = MARGIN
    anchor_weight: float = 0.2
    top_m: int = TOP_M
    composer_kl_weighting: str = "rollout_mean"
    composer_margin_weighting: str = "rollout_mean"
    logits_chunk: int = LOGITS_CHUNK
    logits_dtype: str = "float32"
    grpo_clip_eps: float = 0.2
    is_correction: str = "none"
    is_cap: float = 2.0

    def __post_init__(self):
        if self.composer_kl_weighting not in COMPOSER_KL_WEIGHTINGS:
            raise ValueError(f"composer_kl_weighting={self.composer_kl_weighting!r}; "
                             f"choose one of {COMPOSER_KL_WEIGHTINGS}.")
        if self.composer_margin_weighting not in COMPOSER_MARGIN_WEIGHTINGS:
            raise ValueError(f"composer_margin_weighting={self.composer_margin_weighting!r}; "
                             f"choose one of {COMPOSER_MARGIN_WEIGHTINGS} (rollout_mean: the release).")
        if self.logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"logits_dtype={self.logits_dtype!r}; use float32 (release) or compute.")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(f"is_correction={self.is_correction!r}; choose one of {IS_CORRECTIONS} "
                             "(none: on-policy losses; tis: truncated weights; mis: masked samples).")
        if not (math.isfinite(self.is_cap) and self.is_cap > 1.0):
            raise ValueError(f"is_cap={self.is_cap} must be a finite number > 1 (the largest importance "
                             "ratio kept; 2.0 is the default).")
        if self.logits_chunk < 1 or self.top_m < 1:
            raise ValueError(f"logits_chunk={self.logits_chunk} and top_m={self.top_m} must be >= 1.")

    def logits_jnp_dtype(self, compute_dtype):
        """The LM-head matmul's accumulation / output dtype for ``compute_dtype`` inputs."""
        return jnp.float32 if self.logits_dtype == "float32" else compute_dtype
