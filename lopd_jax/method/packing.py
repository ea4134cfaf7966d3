"""Packed rows inside the jitted steps: per-trajectory views of packed arrays, and the
teacher forward over packed rows with each segment's own latent block.

A packed pass (built on the host by :mod:`train.packed_batches`) holds ``P`` rows, each
with up to ``K`` whole trajectories (*segments*) back to back. Token arrays are packed
``[P, S]``; per-trajectory arrays are ``[P, K, ...]``; ``unpack_index [P, K, L]`` gives,
for segment ``k`` of row ``p``, the packed position of its ``i``-th token (-1 past its
end). The losses' per-trajectory reductions (rollout means, per-rollout Delta, group
advantages) run on the *unpacked* per-token statistics ``[P * K, L]`` -- a gather of a
few floats per token -- so they are the padded step's, term for term; the model and the
LM head run on the packed rows. docs/packing.md gives the layout and the exactness argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_rows(x: jax.Array) -> jax.Array:
    """A per-trajectory array ``[P, K, ...]`` as rows ``[P * K, ...]`` (segment order)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unpack(x: jax.Array, index: jax.Array) -> jax.Array:
    """Packed ``[P, T]`` values -> ``[P * K, L]`` per trajectory (``index [P, K, L]``);
    entries whose index is -1 or at least ``T`` are 0. Works for token arrays ``[P, S]``
    and for next-token arrays ``[P, S - 1]`` (a segment's last token, whose prediction
    would cross into the next segment, then falls out, as padding does in a padded row)."""
    P, K, L = index.shape
    flat = index.reshape(P, K * L)
    ok = (flat >= 0) & (flat < x.shape[1])
    out = jnp.take_along_axis(x, jnp.clip(flat, 0, x.shape[1] - 1), axis=1)
    return jnp.where(ok, out, jnp.zeros((), x.dtype)).reshape(P * K, L)


def scatter(values: jax.Array, index: jax.Array, length: int) -> jax.Array:
    """Inverse of :func:`unpack`: per-trajectory ``[P * K, L]`` values into packed
    ``[P, length]`` rows (0 where no segment token lands)."""
    P, K, L = index.shape
    flat = index.reshape(P, K * L)
    flat = jnp.where((flat >= 0) & (flat < length), flat, length)
    rows = jnp.arange(P)[:, None]
    return jnp.zeros((P, length), values.dtype).at[rows, flat].set(values.reshape(P, K * L), mode="drop")


def teacher_slot_mask(batch: dict, slot_valid: jax.Array | None) -> jax.Array:
    """The packed teacher's attention mask ``[P, S_T]``: ``teacher_attention_mask``, with the
    latent slots whose ``slot_valid [P * K, slots]`` entry is False (experiences the bank
    could not supply) masked out."""
    mask = batch["teacher_attention_mask"].astype(bool)
    if slot_valid is None:
        return mask
    slot = batch["teacher_slot"]
    P = slot.shape[0]
    flat = slot_valid.reshape(P, -1).astype(bool)
    ok = jnp.take_along_axis(flat, jnp.clip(slot, 0, flat.shape[1] - 1), axis=1)
    return mask & jnp.where(slot >= 0, ok, True)


def splice_packed_latents(embeds: jax.Array, latents: jax.Array, slot: jax.Array) -> jax.Array:
    """Replace the slot rows of packed teacher embeddings ``[P, S_T, D]`` by their segment's
    latents ``[P * K, slots, D]``; ``slot [P, S_T]`` holds ``k * slots + j`` at latent ``j``
    of segment ``k``, -1 elsewhere."""
    P = slot.shape[0]
    flat = latents.reshape(P, -1, latents.shape[-1])
    picked = jnp.take_along_axis(flat, jnp.clip(slot, 0, flat.shape[1] - 1)[..., None], axis=1)
    return jnp.where((slot >= 0)[..., None], picked.astype(embeds.dtype), embeds)


def align_packed(hidden: jax.Array, align: jax.Array) -> jax.Array:
    """Teacher hidden states ``[P, S_T, D]`` at the student's packed positions
    (``align [P, S]``: the teacher position of each student token)."""
    return jnp.take_along_axis(hidden, align[..., None], axis=1)


def packed_teacher_hidden(teacher, batch: dict, latents=None, slot_valid=None, lora: bool = False) -> jax.Array:
    """The teacher's final hidden states over a packed pass, aligned to the student's
    packed positions ``[P, S, D]``.

    The teacher row (``teacher_tokens`` / ``teacher_segment_ids`` / ``teacher_attention_mask``,
    host-built) holds each segment with its own block -- the latent splice or a text
    context -- at its own insertion point; positions restart per segment, so every segment
    sees what its padded row's teacher sees. ``latents [P * K, slots, D]`` fill the slots
    (``teacher_slot``; None: no latents, e.g. text blocks); ``slot_valid`` masks missing
    experiences' slots."""
    ids = batch["teacher_tokens"]
    emb = teacher.embed_tokens(ids)
    if latents is not None:
        emb = splice_packed_latents(emb, latents, batch["teacher_slot"])
    hidden = teacher(inputs_embeds=emb, attention_mask=teacher_slot_mask(batch, slot_valid),
                     segment_ids=batch["teacher_segment_ids"], lora=lora, return_hidden=True)
    return align_packed(hidden, batch["teacher_align"])


def is_packed(batch: dict) -> bool:
    """Whether a step batch is a packed pass (it carries ``segment_ids``)."""
    return "segment_ids" in batch


__all__ = ["segment_rows", "unpack", "scatter", "teacher_slot_mask", "splice_packed_latents", "align_packed",
           "packed_teacher_hidden", "is_packed"]
