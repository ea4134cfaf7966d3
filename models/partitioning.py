"""Logical axis names -> mesh axes.

Every parameter carries ``logical_axes`` metadata (e.g. ``("layers", "embed", "mlp")``) and
key activations are constrained with logical names prefixed ``act_``. Rules map each
logical name to a mesh axis (or a tuple of axes, or None = replicated). A dimension whose
size is not divisible by its mesh axes is replicated instead (recorded in
``Rules.dropped`` so callers can report it) -- e.g. 8 kv heads on a 16-way tensor axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("lora_rank", None),
    ("kv", "tensor"),
    ("latents", None),
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


@dataclasses.dataclass(frozen=True)
class Rules:
    """A mesh plus logical-axis rules; turns logical names into shardings."""

    mesh: Mesh
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = DEFAULT_RULES

    def _mesh_axes(self, name: str | None):
        if name is None:
            return None
        table = dict(self.rules)
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; add it to the mesh rules.")
        axes = table[name]
        if axes is None:
            return None
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a in self.mesh.shape and self.mesh.shape[a] > 1)
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else axes

    def spec(self, logical: Sequence[str | None], shape: Sequence[int] | None = None) -> P:
        """PartitionSpec for logical names; drops axes that do not divide ``shape``."""
        out, used = [], set()
        for i, name in enumerate(logical):
            axes = self._mesh_axes(name)
            if axes is not None:
                tup = (axes,) if isinstance(axes, str) else axes
                size = 1
                for a in tup:
                    size *= self.mesh.shape[a]
                if any(a in used for a in tup) or (shape is not None and shape[i] % size):
                    axes = None
                else:
                    used.update(tup)
            out.append(axes)
        return P(*out)

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        """NamedSharding for logical names on this mesh."""
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def replicated(self) -> NamedSharding:
        """A fully replicated sharding on this mesh."""
        return NamedSharding(self.mesh, P())


def constrain(x: jax.Array, logical: Sequence[str | None], rules: Rules | None) -> jax.Array:
    """``with_sharding_constraint`` by logical names; identity when no mesh is given."""
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.sharding(logical, x.shape))
def _is_var(x):
    return isinstance(x, nnx.Variable)


def split_state(module: nnx.Module, *filters):
    """``nnx.split`` returning pure-dict states plus their logical axes.

    Returns ``(graphdef, [pure_dict, ...], [axes_dict, ...])``, one per filter.
    """
    graphdef, *states = nnx.split(module, *filters)
    pure = [s.to_pure_dict() for s in states]
    axes = [nnx.State(jax.tree.map(lambda v: tuple(v.logical_axes), s, is_leaf=_is_var)).to_pure_dict()
            if len(s) else {} for s in states]
    return graphdef, pure, axes


def tree_shardings(tree: Any, axes: Any, rules: Rules | None):
    """NamedShardings for a pure-dict ``tree`` given its logical ``axes`` tree."""
    if rules is None:
        return None
    return jax.tree.map(lambda x, a: rules.sharding(a, np.shape(x)), tree, axes,
                        is_leaf=lambda a: isinstance(a, tuple) and all(isinstance(n, (str, type(None))) for n in a))


