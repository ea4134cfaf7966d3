"""The run config's section dataclasses that the training machinery reads: the mesh
(:class:`MeshConfig`), the steps (:class:`StepConfig`), sampling (:class:`SamplingParams`),
episode caps (:class:`RolloutConfig`) and the rollout engine (:class:`EngineConfig`).

They live with the settings so the config schema (:mod:`lopd_jax.settings.config`) needs
nothing from ``train/``; ``train/`` reads them from here.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.keys import inline
from models.partitioning import DEFAULT_RULES


MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over the named axes ``data``, ``fsdp`` and ``tensor``.

    One entry may be -1 ("all remaining devices"). ``rules`` maps logical axis names to
    mesh axes (see :mod:`models.partitioning`).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: tuple = DEFAULT_RULES

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """Concrete (data, fsdp, tensor) sizes for ``num_devices`` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        if sizes.count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"{num_devices} devices do not divide into mesh {dict(zip(MESH_AXES, sizes))}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but "
                f"{num_devices} are available; change the mesh sizes in the config."
            )
        return tuple(sizes)


STUDENT_MODES = ("full", "lora")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Hyperparameters of the LOPD / cold-start / GRPO steps (docs/method.md, "Defaults").

    ``loss``: the objective's settings (:class:`lopd_jax.method.loss_config.LossConfig`,
    inline: its keys read ``steps.margin``, ``steps.logits_chunk``, ...); ``eta_beta``: the
    dual step size on beta. ``micro_batch``: trajectories per data shard per forward /
    backward pass of the LOPD step (gradient accumulation inside the one jitted step;
    exact, see :func:`train.steps.make_lopd_step`); 0 = every local trajectory in one pass.

    Choices that follow the authors' release by default (docs/release_parity.md):
    ``weight_decay`` (0.01, torch AdamW's default), ``skip_nonfinite`` (skip the whole
    update -- student, composer, beta -- when a gradient norm or Delta is not finite) and
    ``max_nonfinite_skips`` (the loop stops after that many consecutive skipped steps;
    0 = never); the loss's own (:class:`lopd_jax.method.loss_config.LossConfig`).
    """

    loss: LossConfig = inline(LossConfig())
    eta_beta: float = 0.5
    freeze_composer: bool = False
    student_mode: str = "full"
    student_lr: float = 1e-5
    composer_lr: float = 1e-5
    student_clip: float = 1.0
    composer_clip: float = 1.0
    weight_decay: float = 0.01
    cold_start_lr: float = 1e-5
    cold_start_encoder_clip: float = 3.0
    cold_start_compressor_clip: float = 30.0
    micro_batch: int = 0
    skip_nonfinite: bool = True
    max_nonfinite_skips: int = 10

    def __post_init__(self):
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch={self.micro_batch}; use 0 (no accumulation) or a positive count.")
        if self.student_mode not in STUDENT_MODES:
            raise ValueError(f"student_mode={self.student_mode!r}; choose from {STUDENT_MODES}.")
        if self.max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips={self.max_nonfinite_skips} must be >= 0 (0 = never stop).")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Episode caps (docs/method.md, "Rollout"). ``max_observation_chars``: the longest text one observation
    message may hold; a longer one is cut before it is tokenized, with a note saying so.
    Host-side parallelism is the engine's (:attr:`EngineConfig.env_workers`)."""

    max_env_steps: int = 30
    max_turn_tokens: int = 2048
    max_total_tokens: int = 40_960
    max_observation_chars: int = 65_536

    def __post_init__(self):
        for name in ("max_env_steps", "max_turn_tokens", "max_total_tokens", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (docs/method.md, "Defaults"). ``temperature == 0`` is greedy; ``top_k = 0``
    and ``top_p = 1`` disable those filters.

    Also a JAX pytree, so the engine's device calls take it whole: ``temperature`` and
    ``top_p`` are its leaves (traced: a new value does not recompile), ``top_k`` and
    :attr:`greedy` its static part."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k}")
        object.__setattr__(self, "_greedy", self.temperature == 0)

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (``temperature == 0``); static under ``jit``."""
        return self._greedy


def _flatten_sampling(sp: SamplingParams):
    return (sp.temperature, sp.top_p), (sp.top_k, sp.greedy)


def _unflatten_sampling(static, leaves) -> SamplingParams:
    """Rebuilt from (possibly traced) leaves without re-running the checks."""
    sp = object.__new__(SamplingParams)
    for name, value in zip(("temperature", "top_p", "top_k", "_greedy"), (*leaves, *static)):
        object.__setattr__(sp, name, value)
    return sp


jax.tree_util.register_pytree_node(SamplingParams, _flatten_sampling, _unflatten_sampling)


ENGINE_DTYPES = ("float32", "bfloat16")  # the engine's sampling dtypes (EngineConfig.dtype)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings (the run config's ``engine`` section).

    ``slots``: decode rows on the device (per process); ``page_size``: tokens per KV page
    (64-128 on TPU); ``num_pages``: pages in the pool (per process; 0 = enough for every
    slot at the episode cap); ``decode_chunk``: decode steps per device call (K);
    ``prefill_chunk``: tokens per row per prefill call (longer chunks take several calls);
    ``max_in_flight``: episodes started and not finished at once (0 = no limit: every
    episode of a rollout may hold pages); ``env_workers``: threads running environment
    steps (0 = on the engine's own thread, between device calls); ``env_timeout_s``: the
    longest one environment step may run on those threads before the engine ends its episode
    as an environment error and abandons the thread (0 = no limit; steps on the engine's
    thread cannot be timed out).
    Compiled variants: one prefill and one decode per power-of-two count of pages read.
    None of these settings changes a sampled token (see the module docstring).

    The device layout (:mod:`lopd_jax.rollout.layout`): ``devices``: this process's local
    devices the engine runs on (0 = all of them); ``tensor``: tensor-parallel width over
    them (0 = :func:`lopd_jax.rollout.layout.default_tensor`, the largest that divides both
    the devices and the KV heads; the rest is ``data``); ``dtype``: the sampling dtype of
    weights, compute and KV pages (``float32`` or ``bfloat16``). These may change rounding
    (fp32: within 1e-5 of one device), not the schedule.
    """

    slots: int = 8
    page_size: int = 64
    num_pages: int = 0
    decode_chunk: int = 16
    prefill_chunk: int = 256
    max_in_flight: int = 0
    env_workers: int = 4
    env_timeout_s: float = 300.0
    devices: int = 1
    tensor: int = 1
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("slots", "page_size", "decode_chunk", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name}={getattr(self, name)} must be >= 1.")
        for name, what in (("num_pages", "0 = sized from the slots"), ("max_in_flight", "0 = no limit"),
                           ("env_workers", "0 = on the engine's thread"), ("devices", "0 = every local device"),
                           ("tensor", "0 = the default width")):
            if getattr(self, name) < 0:
                raise ConfigError(f"engine.{name}={getattr(self, name)} must be >= 0 ({what}).")
        if not self.env_timeout_s >= 0:
            raise ConfigError(f"engine.env_timeout_s={self.env_timeout_s} must be >= 0 (0 = no limit).")
        if self.dtype not in ENGINE_DTYPES:
            raise ConfigError(f"engine.dtype={self.dtype!r} must be one of {ENGINE_DTYPES} (the sampling dtype).")


__all__ = ["ENGINE_DTYPES", "EngineConfig", "MESH_AXES", "MeshConfig", "RolloutConfig",
           "STUDENT_MODES", "SamplingParams", "StepConfig"]
