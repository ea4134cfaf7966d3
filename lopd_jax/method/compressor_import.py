"""Import a composer compressor trained by the authors' PyTorch release into the Flax
:class:`lopd_jax.method.compressor.Compressor` (docs/release_parity.md, "Loading a release
composer").

The release's compressor is a Perceiver-resampler-style module (docs/method.md,
"Compressor"); its ``state_dict()`` keys (optionally under a prefix such as
``"compressor."``) are ``latents``, ``proj_in``, ``block.attn.{norm_media, norm_latents,
to_q, to_kv, to_out}``, ``block.ff.{0, 1, 3}``, ``proj_out`` and ``norm_out``; separate
``to_k`` / ``to_v`` are accepted in place of ``to_kv``. torch Linear weights are
``[out, in]`` and are transposed to Flax's ``[in, out]``. The Flax compressor must be
built with ``ff_bias=False`` (the default) so the map is one to one; every key is checked
(missing, unexpected, shape) with a clear error.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.method.compressor import Compressor

# Flax path -> (torch name, transpose)
_LN = {"scale": ("weight", False), "bias": ("bias", False)}


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().float().numpy()
    return np.asarray(x, np.float32)


def _name_map(has_kv: bool) -> dict[tuple[str, ...], tuple[str, bool]]:
    m: dict[tuple[str, ...], tuple[str, bool]] = {
        ("queries",): ("latents", False),
        ("proj_in", "kernel"): ("proj_in.weight", True), ("proj_in", "bias"): ("proj_in.bias", False),
        ("block", "q_proj", "kernel"): ("block.attn.to_q.weight", True),
        ("block", "o_proj", "kernel"): ("block.attn.to_out.weight", True),
        ("block", "ff_in", "kernel"): ("block.ff.1.weight", True),
        ("block", "ff_out", "kernel"): ("block.ff.3.weight", True),
        ("proj_out", "kernel"): ("proj_out.weight", True), ("proj_out", "bias"): ("proj_out.bias", False),
    }
    for flax_ln, torch_ln in (("norm_media", "block.attn.norm_media"), ("norm_latents", "block.attn.norm_latents"),
                              ("ff_norm", "block.ff.0"), ("norm_out", "norm_out")):
        path = ("block", flax_ln) if flax_ln != "norm_out" else (flax_ln,)
        for leaf, (suffix, tr) in _LN.items():
            m[path + (leaf,)] = (f"{torch_ln}.{suffix}", tr)
    if not has_kv:
        m[("block", "k_proj", "kernel")] = ("block.attn.to_k.weight", True)
        m[("block", "v_proj", "kernel")] = ("block.attn.to_v.weight", True)
    return m


def release_compressor_params(state_dict: Mapping[str, Any], compressor: Compressor,
                              prefix: str = "") -> dict:
    """The Flax parameter tree (pure dict) of ``compressor`` filled from a release state dict.

    ``prefix`` is stripped from the keys (e.g. ``"compressor."`` for a whole composer's
    state dict; keys without it are ignored). Raises ``ValueError`` on a missing,
    unexpected or mis-shaped key, or when ``compressor`` has feed-forward biases.
    """
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    has_kv = "block.attn.to_kv.weight" in sd
    names = _name_map(has_kv)
    target = nnx.to_pure_dict(nnx.state(compressor, nnx.Param))
    flat: dict[tuple[str, ...], Any] = {}

    def walk(tree, path=()):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, path + (k,))
            else:
                flat[path + (k,)] = v

    walk(target)
    extra_flax = sorted(".".join(p) for p in flat if p not in names and p[1:2] not in (("k_proj",), ("v_proj",)))
    if extra_flax:
        raise ValueError(f"the Flax compressor has parameters the release has no counterpart for: {extra_flax}; "
                         "build it with ff_bias=False (composer.ff_bias=false) to load a release checkpoint.")
    used = set()
    out: dict[tuple[str, ...], np.ndarray] = {}
    for path, (name, transpose) in names.items():
        if name not in sd:
            raise ValueError(f"release state dict lacks {prefix}{name} (for {'.'.join(path)}); "
                             f"keys found: {sorted(sd)[:12]}...")
        arr = _to_numpy(sd[name])
        out[path] = arr.T if transpose else arr
        used.add(name)
    if has_kv:
        kv = _to_numpy(sd["block.attn.to_kv.weight"])
        d = kv.shape[0] // 2
        out[("block", "k_proj", "kernel")], out[("block", "v_proj", "kernel")] = kv[:d].T, kv[d:].T
        used.add("block.attn.to_kv.weight")
    unexpected = sorted(set(sd) - used)
    if unexpected:
        raise ValueError(f"release state dict has keys the Flax compressor does not use: "
                         f"{[prefix + k for k in unexpected]}")
    result: dict = {}
    for path, ref in flat.items():
        arr = out[path]
        if arr.shape != tuple(ref.shape):
            raise ValueError(f"{'.'.join(path)}: release tensor has shape {arr.shape}, the Flax compressor "
                             f"expects {tuple(ref.shape)} (check d, K, ff_mult and num_heads).")
        node = result
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jnp.asarray(arr, ref.dtype)
    return result


def load_release_compressor(compressor: Compressor, state_dict: Mapping[str, Any], prefix: str = "") -> Compressor:
    """Copy a release state dict into ``compressor`` in place (see :func:`release_compressor_params`)."""
    state = nnx.state(compressor, nnx.Param)
    nnx.replace_by_pure_dict(state, release_compressor_params(state_dict, compressor, prefix))
    nnx.update(compressor, state)
    return compressor
