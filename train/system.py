"""The static pieces of an LOPD run and its functional state.

:class:`LOPDSystem` holds the graph definitions (backbone with its LoRA slots,
compressor), the splice layout, step settings and sharding rules. Jitted steps take
pure-dict state and rebuild modules with ``nnx.merge`` inside the trace, so parameters
are ordinary arguments (donated, sharded) and never captured constants.

State layout (all pure dicts of arrays)::

    frozen = theta0 backbone params (teacher and encoder share it; never donated)
    state  = {"step", "beta", "rng",
              "student": full backbone params | student LoRA params,
              "student_opt",
              "composer": {"lora": encoder LoRA, "compressor": compressor params},
              "composer_opt",
              "composer0": frozen copy of the cold-start composer (anchor)}
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lopd_jax.method.composer import ComposerConfig, compose, make_compressor
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.settings.sections import StepConfig
from models.decoder import Decoder
from models.lora import LoRAParam
from models.partitioning import Rules, split_state, tree_shardings
from train import mesh as mesh_lib

def adamw(lr: float, clip: float, weight_decay: float) -> optax.GradientTransformation:
    """Global-norm clipping followed by AdamW."""
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr, weight_decay=weight_decay))


class LOPDSystem:
    """Graph definitions, layouts, optimizers and shardings for the jitted steps."""

    def __init__(self, backbone: Decoder, compressor, composer_cfg: ComposerConfig, layout: SpliceLayout,
                 step_cfg: StepConfig = StepConfig(), rules: Rules | None = None):
        if backbone.cfg.lora is None:
            raise ValueError("the backbone needs LoRA slots for the encoder: build it with cfg.lora set "
                             "(ComposerConfig.lora).")
        if layout.num_slots != composer_cfg.num_slots:
            raise ValueError(f"splice layout has {layout.num_slots} slots but the composer makes "
                             f"{composer_cfg.num_slots} latents (n_ret * K).")
        self.model_cfg = backbone.cfg
        self.composer_cfg = composer_cfg
        self.layout = layout
        self.step_cfg = step_cfg
        self.rules = rules
        self.backbone_def, (self._theta0, self._lora0), (self.theta_axes, self.lora_axes) = split_state(
            backbone, nnx.Param, LoRAParam)
        self.compressor_def, (self._comp0,), (self.comp_axes,) = split_state(compressor, nnx.Param)
        s = step_cfg
        self.student_opt = adamw(s.student_lr, s.student_clip, s.weight_decay)
        self.composer_opt = adamw(s.composer_lr, s.composer_clip, s.weight_decay)
        self.cold_start_opt = {
            "lora": adamw(s.cold_start_lr, s.cold_start_encoder_clip, s.weight_decay),
            "compressor": adamw(s.cold_start_lr, s.cold_start_compressor_clip, s.weight_decay),
        }

    @classmethod
    def create(cls, backbone: Decoder, composer_cfg: ComposerConfig, layout: SpliceLayout,
               step_cfg: StepConfig = StepConfig(), rules: Rules | None = None, seed: int = 0) -> "LOPDSystem":
        """Build the compressor for ``backbone`` and the system around both."""
        compressor = make_compressor(backbone.cfg, composer_cfg, nnx.Rngs(seed))
        return cls(backbone, compressor, composer_cfg, layout, step_cfg, rules)

    # ----- module views -----
    def backbone(self, params, lora) -> Decoder:
        """A Decoder over ``params`` (backbone) and ``lora`` (adapter) pure dicts."""
        return nnx.merge(self.backbone_def, params, lora)

    def compressor(self, params):
        """The compressor over a pure-dict ``params``."""
        return nnx.merge(self.compressor_def, params)

    def latents(self, frozen, composer, exp_tokens, exp_mask, dropout_rng=None):
        """c_phi [B, n_ret * K, d] for composer params ``{"lora", "compressor"}``."""
        encoder = self.backbone(frozen, composer["lora"])
        return compose(encoder, self.compressor(composer["compressor"]), exp_tokens, exp_mask, dropout_rng)

    def student(self, state_student, frozen, composer_lora):
        """(student module, use_lora) for the configured student mode."""
        if self.step_cfg.student_mode == "full":
            return self.backbone(state_student, jax.lax.stop_gradient(composer_lora)), False
        return self.backbone(frozen, state_student), True

    # ----- state -----
    def initial_params(self):
        """(frozen theta0, encoder LoRA, compressor) pure dicts as built."""
        return self._theta0, self._lora0, self._comp0

    def init_state(self, composer=None, seed: int = 0):
        """(state, frozen) for LOPD; ``composer`` defaults to the freshly built one (phi0)."""
        if composer is None:
            composer = {"lora": self._lora0, "compressor": self._comp0}
        return self._state_from(self._theta0, composer, self._lora0, seed), self._theta0

    def abstract_state(self, seed: int = 0):
        """(state, frozen) as ShapeDtypeStructs, without allocating (for AOT compilation)."""
        composer = {"lora": self._lora0, "compressor": self._comp0}
        state = jax.eval_shape(lambda t, c, lo: self._state_from(t, c, lo, seed), self._theta0, composer, self._lora0)
        frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._theta0)
        return state, frozen

    def _state_from(self, frozen, composer, fresh_lora, seed):
        copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (no buffer shared with frozen)
        # a LoRA-only student starts from a fresh adapter (B = 0), i.e. exactly theta0
        student = copy(frozen) if self.step_cfg.student_mode == "full" else copy(fresh_lora)
        return {
            "step": jnp.zeros((), jnp.int32),
            "beta": jnp.zeros((), jnp.float32),
            "rng": jax.random.PRNGKey(seed),
            "student": student,
            "student_opt": self.student_opt.init(student),
            "composer": copy(composer),
            "composer_opt": self.composer_opt.init(composer),
            "composer0": copy(composer),
        }

    def init_cold_start_state(self, seed: int = 0):
        """State for the cold start: composer params, their two optimizer groups, step, rng."""
        composer = {"lora": jax.tree.map(jnp.copy, self._lora0), "compressor": jax.tree.map(jnp.copy, self._comp0)}
        return {
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.PRNGKey(seed),
            "composer": composer,
            "composer_opt": {k: self.cold_start_opt[k].init(composer[k]) for k in composer},
        }

    # ----- shardings -----
    def frozen_shardings(self):
        """Shardings of theta0 (None without a mesh)."""
        return tree_shardings(self._theta0, self.theta_axes, self.rules)

    def composer_shardings(self):
        """Shardings of ``{"lora", "compressor"}`` composer params."""
        if self.rules is None:
            return None
        return {"lora": tree_shardings(self._lora0, self.lora_axes, self.rules),
                "compressor": tree_shardings(self._comp0, self.comp_axes, self.rules)}

    def state_shardings(self, state):
        """Shardings for an LOPD ``state`` dict (None without a mesh)."""
        if self.rules is None:
            return None
        rep = self.rules.replicated()
        if self.step_cfg.student_mode == "full":
            student = self.frozen_shardings()
        else:
            student = tree_shardings(self._lora0, self.lora_axes, self.rules)
        comp = self.composer_shardings()
        return {
            "step": rep, "beta": rep, "rng": rep,
            "student": student,
            "student_opt": mesh_lib.opt_state_shardings(self.student_opt, state["student_opt"], student, self.rules),
            "composer": comp,
            "composer_opt": mesh_lib.opt_state_shardings(self.composer_opt, state["composer_opt"], comp, self.rules),
            "composer0": comp,
        }

    def cold_start_shardings(self, state):
        """Shardings for a cold-start state dict (None without a mesh)."""
        if self.rules is None:
            return None
        rep = self.rules.replicated()
        comp = self.composer_shardings()
        return {
            "step": rep, "rng": rep, "composer": comp,
            "composer_opt": {k: mesh_lib.opt_state_shardings(self.cold_start_opt[k], state["composer_opt"][k],
                                                             comp[k], self.rules) for k in comp},
        }

    def batch_shards(self, batch_size: int) -> int:
        """How many ways the batch dimension of ``batch_size`` rows is split on the mesh."""
        if self.rules is None:
            return 1
        axes = self.rules.spec(("act_batch",), (batch_size,))[0]
        if axes is None:
            return 1
        axes = (axes,) if isinstance(axes, str) else axes
        n = 1
        for a in axes:
            n *= self.rules.mesh.shape[a]
        return n

    def batch_shardings(self, batch: dict[str, Any]):
        """Batch-major shardings for every array of a batch dict."""
        if self.rules is None:
            return None
        return {k: mesh_lib.batch_sharding(self.rules, jnp.ndim(v)) for k, v in batch.items()}
