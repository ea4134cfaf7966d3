"""Text contexts for the self-distillation arms with a text teacher context (``train/arms/text.py``).

Their teacher sees the student's tokens with a block of *text tokens* inserted where LOPD
splices its latent block (``Trajectory.insert_at``)::

    student:  prompt[:a]                                 + prompt[a:] + turns
    teacher:  prompt[:a] + framing_before + text + framing_after + prompt[a:] + turns

Blocks differ in length per row, so the host packs them into a ``[B, C]`` array with their
lengths (:func:`context_block_ids`, :func:`pack_blocks`); the jitted step builds each row's
teacher sequence (:func:`text_teacher_inputs`) and aligns the teacher's hidden states back
to the student's positions (:func:`align_teacher_hidden`). Host-side text makers:
:func:`trajectory_text`, :func:`skill_summary`; each arm frames its text with its own
sentences (:data:`HINT_FRAMING`: the oracle hint's).
"""

from __future__ import annotations

import json
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from lopd_jax.core.text import content_ids
from lopd_jax.method.bank import linearize

# (before, after) framing of the oracle hint as text (``opsd``; the premise's hinted source).
HINT_FRAMING = ("Privileged information: a correct solution of this task:",
                "End of privileged information. Now solve the task.")


def context_block_ids(tokenizer, framing: tuple[str, str], text: str, max_tokens: int) -> list[int]:
    """``before + "\\n" + text + "\\n" + after + "\\n\\n"`` as ids (``framing = (before,
    after)``, each text arm's own sentences), at most ``max_tokens`` long (the text is cut,
    never the framing; a control string in it stays text: :func:`lopd_jax.core.text.content_ids`).
    Pieces are tokenized separately, as :meth:`lopd_jax.method.splice.SpliceLayout.from_tokenizer`
    does the latent block's framing."""
    before, after = framing
    enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    b, a = enc(before + "\n"), enc("\n" + after + "\n\n")
    room = max_tokens - len(b) - len(a)
    if room < 1:
        raise ValueError(f"arms.context_tokens={max_tokens} leaves no room for text after the framing "
                         f"{before!r} ... {after!r} ({len(b) + len(a)} tokens); raise it.")
    return b + content_ids(tokenizer, text)[:room] + a  # content: control strings stay text


def pack_blocks(blocks: Sequence[Sequence[int] | None], width: int, pad_id: int = 0):
    """``(ctx_ids int32 [B, width], ctx_len int32 [B])``: blocks left-packed, None = empty."""
    ids = np.full((len(blocks), width), pad_id, np.int32)
    lens = np.zeros(len(blocks), np.int32)
    for b, blk in enumerate(blocks):
        if blk:
            if len(blk) > width:
                raise ValueError(f"context block of {len(blk)} tokens is wider than {width}")
            ids[b, :len(blk)] = blk
            lens[b] = len(blk)
    return ids, lens


def text_teacher_inputs(tokens, attention_mask, insert_at, ctx_ids, ctx_len):
    """Teacher ids and attention mask ``[B, S + C]`` with row ``b``'s block
    ``ctx_ids[b, :ctx_len[b]]`` inserted at ``insert_at[b]`` (jit-able)."""
    S, C = tokens.shape[1], ctx_ids.shape[1]
    p = jnp.arange(S + C)[None, :]
    ins, n = insert_at[:, None], ctx_len[:, None]
    in_block = (p >= ins) & (p < ins + n)
    src = jnp.where(p < ins, p, p - n)
    from_student = jnp.take_along_axis(tokens, jnp.clip(src, 0, S - 1), axis=1)
    from_block = jnp.take_along_axis(ctx_ids, jnp.clip(p - ins, 0, C - 1), axis=1)
    ids = jnp.where(in_block, from_block, from_student)
    student_mask = jnp.take_along_axis(attention_mask.astype(bool), jnp.clip(src, 0, S - 1), axis=1)
    mask = jnp.where(in_block, True, student_mask & (src < S))
    return ids, mask


def align_teacher_hidden(hidden, insert_at, ctx_len, length: int):
    """Teacher hidden states ``[B, S + C, D]`` -> ``[B, length, D]`` at the student's
    positions (student ``j`` is teacher ``j`` before the insertion point, ``j + n`` after)."""
    j = jnp.arange(length)[None, :]
    idx = jnp.where(j < insert_at[:, None], j, j + ctx_len[:, None])
    return jnp.take_along_axis(hidden, idx[..., None], axis=1)


def trajectory_text(experience, max_obs_chars: int | None = 120) -> str:
    """A trajectory (a :class:`lopd_jax.method.bank.Experience`) as text: one line per step,
    ``Step i: tool calls -> observations`` (:func:`lopd_jax.method.bank.linearize`)."""
    return linearize(experience, max_obs_chars=max_obs_chars)


def skill_summary(experience) -> str:
    """A reusable procedure abstracted from a successful trajectory: the order of its
    tool calls with their argument names (values left out, so the skill transfers to
    other tasks of the family), then how it ended."""
    lines, answer = [], ""
    for msg in experience.messages:
        if msg.get("role") != "assistant":
            continue
        calls = msg.get("tool_calls") or []
        for c in calls:
            fn = c.get("function", c)
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = {}
            keys = ", ".join(sorted(args)) if isinstance(args, dict) else ""
            lines.append(f"{len(lines) + 1}. call {fn.get('name')}({keys})")
        if not calls and (msg.get("content") or "").strip():
            answer = "then give the final answer in one short message."
    family = (experience.info or {}).get("family") or experience.env_id
    head = f"Skill for {family} tasks: fill each argument from the task's own names and numbers."
    return "\n".join([head] + lines + ([answer] if answer else []))
