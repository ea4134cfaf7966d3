"""Host-side rows of the engine's device calls (:mod:`lopd_jax.rollout.engine_calls`): the
rows of a prefill and a decode call (:class:`PrefillRows`, :class:`DecodeRows`), page tables,
input-embedding overrides of a prefill piece, and per-row base keys. No JAX."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from lopd_jax.rollout.episode_spec import EpisodeState

__all__ = ["DecodeRows", "PrefillRows", "embedding_overrides", "page_table", "row_keys"]


class PrefillRows(NamedTuple):
    """One prefill call's rows: ``ids`` [B, C] fed at positions ``start[b]..`` (``n[b]`` of
    them), the ``page_table`` [B, W] (attention reads its W leading pages), episode ids
    ``eids`` [B]; optional ``vectors`` [B, C, D] replace the input embeddings where
    ``use_vec`` [B, C] is set; optional ``keys`` [B, ...] uint32: each row's base key data
    (``jax.random.key_data``) in place of the call's key."""

    ids: Any
    start: Any
    n: Any
    page_table: Any
    eids: Any
    vectors: Any = None
    use_vec: Any = None
    keys: Any = None


class DecodeRows(NamedTuple):
    """One decode call's rows [B]: the last token ``prev``, cached ``lengths``, ``live``
    rows, tokens each may still generate (``remaining``), the ``page_table`` [B, W] and
    episode ids ``eids``; optional per-row base ``keys`` as :class:`PrefillRows`'."""

    prev: Any
    lengths: Any
    live: Any
    remaining: Any
    page_table: Any
    eids: Any
    keys: Any = None


def page_table(eps: Sequence[EpisodeState | None], width: int) -> np.ndarray:
    """``[len(eps), width]`` page ids: each episode's leading ``width`` pages (0 elsewhere)."""
    t = np.zeros((len(eps), width), np.int32)
    for r, ep in enumerate(eps):
        if ep is not None and ep.pages:
            t[r, :min(width, len(ep.pages))] = ep.pages[:width]
    return t


def embedding_overrides(batch: Sequence[EpisodeState], pos: Sequence[int], C: int, rows: int):
    """The input-embedding overrides of one prefill piece (``C`` ids from ``pos[r]``):
    ``(vectors [rows, C, D], use [rows, C])``, or ``(None, None)`` when no row has any."""
    hits = []
    for r, ep in enumerate(batch):
        if ep.spec.embeds is None:
            continue
        start, vec = ep.spec.embeds
        lo, hi = max(start, pos[r]), min(start + len(vec), pos[r] + C, len(ep.ctx))
        if lo < hi:
            hits.append((r, lo - pos[r], np.asarray(vec[lo - start:hi - start])))
    if not hits:
        return None, None
    dim, dtype = hits[0][2].shape[-1], hits[0][2].dtype
    vectors = np.zeros((rows, C, dim), dtype)
    use = np.zeros((rows, C), bool)
    for r, at, vec in hits:
        vectors[r, at:at + len(vec)] = vec
        use[r, at:at + len(vec)] = True
    return vectors, use


def row_keys(eps: Sequence[EpisodeState | None], rows: int, base: np.ndarray | None) -> np.ndarray | None:
    """Each row's base key data (an episode's own, else ``base``), or None for a run whose
    rows all use the run's key (``base`` None)."""
    if base is None:
        return None
    keys = np.broadcast_to(base, (rows, *base.shape)).copy()
    for r, ep in enumerate(eps):
        if ep is not None and ep.spec.rng is not None:
            keys[r] = ep.spec.rng
    return keys
