"""The latent splice: build the teacher sequence from the student sequence.

The method: docs/method.md, "Teacher sequence".

The teacher sees the student's tokens with one fixed block inserted at the start of the
first user message's content::

    framing_before + [num_slots latent slots] + framing_after

The slot ids are placeholders; their input embeddings are replaced by the composer's
latent vectors before the first layer. Positions stay contiguous, so for every student
position j at or after the insertion point, teacher position j + L_ins sees the same
prefix plus the block and predicts the same next token: alignment is the static slice
``teacher_hidden[:, L_ins:]``. All of this runs inside the jitted step (gathers on ids,
no host work).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_FRAMING_BEFORE = "Reference example: a different, already solved task, given as latent memory:"
DEFAULT_FRAMING_AFTER = "End of reference example. Now solve your own task from scratch."


@dataclasses.dataclass(frozen=True)
class SpliceLayout:
    """Token ids of the inserted block: framing before, ``num_slots`` slots, framing after."""

    before_ids: tuple[int, ...]
    after_ids: tuple[int, ...]
    num_slots: int
    slot_id: int

    @property
    def length(self) -> int:
        """L_ins, the number of inserted tokens."""
        return len(self.before_ids) + self.num_slots + len(self.after_ids)

    @property
    def block_ids(self) -> np.ndarray:
        """The inserted block as ids [L_ins] (slots hold ``slot_id``)."""
        return np.asarray(list(self.before_ids) + [self.slot_id] * self.num_slots + list(self.after_ids), np.int32)

    @classmethod
    def from_tokenizer(cls, tokenizer, num_slots: int, slot_token: str | None = None,
                       before: str = DEFAULT_FRAMING_BEFORE, after: str = DEFAULT_FRAMING_AFTER) -> "SpliceLayout":
        """Tokenize the framing texts (framing_before ends with a newline, after starts one)."""
        enc = lambda s: tuple(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
        slot_id = tokenizer.pad_token_id if slot_token is None else tokenizer.convert_tokens_to_ids(slot_token)
        if slot_id is None or (slot_token is not None and slot_id == tokenizer.unk_token_id):
            raise ValueError(f"the tokenizer has no latent slot token {slot_token!r} (and no pad token); "
                             "add one with tokenizer.add_special_tokens or pass slot_token=<an existing token>.")
        return cls(enc(before + "\n"), enc("\n" + after + "\n\n"), num_slots, int(slot_id))


def teacher_tokens(tokens: jax.Array, insert_at: jax.Array, layout: SpliceLayout) -> jax.Array:
    """[B, S] student ids + insertion points [B] -> [B, S + L_ins] teacher ids."""
    B, S = tokens.shape
    L = layout.length
    p = jnp.arange(S + L)[None, :]
    ins = insert_at[:, None]
    block = jnp.asarray(layout.block_ids)
    src = jnp.where(p < ins, p, p - L)
    from_student = jnp.take_along_axis(tokens, jnp.clip(src, 0, S - 1), axis=1)
    from_block = block[jnp.clip(p - ins, 0, L - 1)]
    return jnp.where((p >= ins) & (p < ins + L), from_block, from_student)


def teacher_mask(mask: jax.Array, insert_at: jax.Array, layout: SpliceLayout,
                 slot_mask: jax.Array | None = None) -> jax.Array:
    """Attention mask [B, S + L_ins] for the teacher sequence.

    The inserted block is valid, except the latent slots where ``slot_mask [B, num_slots]``
    is False (slots of experiences the bank could not supply): no position attends to them.
    The other positions keep their RoPE positions (the block's length is fixed).
    """
    B, S = mask.shape
    L = layout.length
    p = jnp.arange(S + L)[None, :]
    ins = insert_at[:, None]
    src = jnp.where(p < ins, p, p - L)
    shifted = jnp.take_along_axis(mask, jnp.clip(src, 0, S - 1), axis=1)
    block = jnp.ones((B, S + L), bool)
    if slot_mask is not None:
        first = ins + len(layout.before_ids)
        idx = jnp.clip(p - first, 0, layout.num_slots - 1)
        is_slot = (p >= first) & (p < first + layout.num_slots)
        block = jnp.where(is_slot, jnp.take_along_axis(slot_mask.astype(bool), idx, axis=1), True)
    return jnp.where((p >= ins) & (p < ins + L), block, shifted)


def splice_latents(embeds: jax.Array, latents: jax.Array, insert_at: jax.Array, layout: SpliceLayout) -> jax.Array:
    """Replace the slot rows of teacher input embeddings [B, S_T, D] by latents [B, num_slots, D]."""
    if latents.shape[1] != layout.num_slots:
        raise ValueError(f"got {latents.shape[1]} latent vectors for {layout.num_slots} slots")
    p = jnp.arange(embeds.shape[1])[None, :]
    first = (insert_at + len(layout.before_ids))[:, None]
    is_slot = (p >= first) & (p < first + layout.num_slots)
    idx = jnp.clip(p - first, 0, layout.num_slots - 1)
    picked = jnp.take_along_axis(latents, idx[..., None], axis=1).astype(embeds.dtype)
    return jnp.where(is_slot[..., None], picked, embeds)


def teacher_hidden_states(teacher, tokens, attention_mask, insert_at, latents, layout: SpliceLayout,
                          slot_mask=None):
    """Teacher final hidden states aligned to the student's positions: [B, S, D].

    ``teacher`` is the frozen backbone (called with LoRA off); ``latents`` [B, slots, D];
    ``slot_mask`` [B, slots] (optional) masks the slots of missing experiences.
    Positions before the insertion point are not aligned (they are never supervised).

    Context cap: the teacher sequence is S + L_ins long -- longer than the student's
    ``rollout.max_total_tokens`` cap by the inserted block (L_ins = framing + n_ret * K,
    about 130 tokens at paper settings). It is not cut: the block adds positions beyond
    the cap and RoPE has no hard limit (docs/release_parity.md).
    """
    t_ids = teacher_tokens(tokens, insert_at, layout)
    t_mask = teacher_mask(attention_mask, insert_at, layout, slot_mask)
    emb = splice_latents(teacher.embed_tokens(t_ids), latents, insert_at, layout)
    hidden = teacher(inputs_embeds=emb, attention_mask=t_mask, lora=False, return_hidden=True)
    return hidden[:, layout.length:]
