"""Device mesh and sharding helpers: logical axes of NNX state -> NamedShardings.

State is handled as pure dicts (``nnx.State.to_pure_dict()``) inside jitted steps; the
logical axes travel beside it as a dict of the same structure, read from each variable's
``logical_axes`` metadata.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lopd_jax.settings.sections import MESH_AXES, MeshConfig
from models.partitioning import Rules

def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A mesh with Auto axis types over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.shape(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def rules_for(mesh: Mesh, cfg: MeshConfig = MeshConfig()) -> Rules:
    """The logical-axis rules of ``cfg`` bound to ``mesh``."""
    return Rules(mesh, tuple(cfg.rules))


def opt_state_shardings(opt: optax.GradientTransformation, opt_state: Any, param_shardings: Any, rules: Rules):
    """Shardings for an optax state: parameter-shaped leaves follow their parameter."""
    rep = rules.replicated()
    return optax.tree_map_params(opt, lambda _, s: s, opt_state, param_shardings,
                                 transform_non_params=lambda _: rep)


def batch_sharding(rules: Rules | None, ndim: int):
    """Sharding for a batch-major array of ``ndim`` dims (batch over data x fsdp)."""
    if rules is None:
        return None
    return rules.sharding(("act_batch",) + (None,) * (ndim - 1))


def replicated(rules: Rules | None):
    """Replicated sharding (None without a mesh)."""
    return None if rules is None else rules.replicated()


def put(tree, shardings):
    """``jax.device_put`` a tree onto shardings (no-op placement without a mesh)."""
    if shardings is None:
        return tree
    return jax.device_put(tree, shardings)


__all__ = ["make_mesh", "rules_for", "opt_state_shardings",
           "batch_sharding", "replicated", "put", "Mesh", "NamedSharding", "P"]
