"""Bytes each chip moves over ICI in one training pass, for the compile check's step estimate.

The step estimate at 100% of peak counts FLOPs only, so it cannot tell a wider tensor axis
(more trajectories per batch shard, so fuller packed rows) from its price: activation
all-reduces in every layer. :func:`pass_collective_bytes` prices the two kinds of traffic
the mesh's rules (:data:`models.partitioning.DEFAULT_RULES`) put on each chip:

- **tensor** (Megatron layout: heads and MLP columns split, the residual stream
  replicated): two all-reduces of the ``[tokens, hidden]`` activations per layer and per
  sweep over the layers -- the forward, the backward into the activations, and with full
  remat the forward recomputed -- plus one per LM-head backward (the vocabulary is split).
  A ring all-reduce over ``t`` chips moves ``2 (t - 1) / t`` times the message per chip.
- **fsdp**: the layers' weights all-gathered once per forward sweep and once per backward
  sweep of each model copy in the pass (a backward sweep's remat forward reuses its gather),
  and the student's gradients reduce-scattered once, ``(f - 1) / f`` of them per chip.

The seconds are ``bytes / ICI bandwidth`` with nothing overlapped with compute: an upper
bound on what the collectives add to the time at peak (XLA overlaps much of it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PassShape:
    """One pass of a training step, for :func:`pass_collective_bytes`.

    ``student_tokens`` / ``teacher_tokens`` / ``encoder_tokens``: tokens each model copy runs
    over in the pass, over the whole mesh (0: that copy does not run); ``*_backward``: whether
    the copy is differentiated (the teacher and encoder into the composer's activations)."""

    student_tokens: float = 0.0
    student_backward: bool = True
    teacher_tokens: float = 0.0
    teacher_backward: bool = True
    encoder_tokens: float = 0.0
    anchor_tokens: float = 0.0


def pass_collective_bytes(shape: PassShape, *, hidden: int, layers: int, layer_params: float, head_params: float,
                          data: int, fsdp: int, tensor: int, remat: bool, act_bytes: int = 2,
                          param_bytes: int = 4) -> dict[str, float]:
    """Per-chip ICI bytes of one pass (see the module docstring): ``{"tensor", "fsdp", "total"}``.

    ``layer_params`` / ``head_params``: parameters of all decoder layers / the LM head;
    ``data``, ``fsdp``, ``tensor``: the mesh; ``remat``: full rematerialisation (one more
    forward sweep per backward); ``act_bytes`` / ``param_bytes``: activation and stored
    parameter widths (bf16 compute, fp32 parameters by default)."""
    groups = data * fsdp  # batch shards: each tensor group runs 1 / groups of the tokens
    ring = 2 * (tensor - 1) / tensor

    def sweeps(backward: bool) -> int:
        return 1 + (1 + int(remat) if backward else 0)  # forward; backward and its remat forward

    copies = ((shape.student_tokens, shape.student_backward, True), (shape.teacher_tokens, shape.teacher_backward, True),
              (shape.encoder_tokens, True, False), (shape.anchor_tokens, False, False))
    tp = fs = 0.0
    for tokens, backward, head in copies:
        if not tokens:
            continue
        n = sweeps(backward)
        per_group = tokens / groups
        tp += ring * per_group * hidden * act_bytes * (2 * layers * n + (int(head and backward)))
        fs += (fsdp - 1) / fsdp * (layer_params + head_params * head) / tensor * param_bytes * (1 + int(backward))
    if shape.student_tokens and shape.student_backward:
        fs += (fsdp - 1) / fsdp * (layer_params + head_params) / tensor * param_bytes  # gradient reduce-scatter
    return {"tensor": tp, "fsdp": fs, "total": tp + fs}


def step_pass_shape(kind: str, rows: int, seq: int, *, n_ret: int, exp_len: int, l_ins: int, ctx_tokens: int = 0,
                    segments: int = 0) -> PassShape:
    """The :class:`PassShape` of one pass of a ``kind`` step (``warmup``, ``cold_start``,
    ``lopd``, ``grpo``, ``text``) over ``rows`` rows of ``seq`` tokens, holding up to
    ``segments`` episodes each when packed (0: one). Token counts follow
    :func:`lopd_jax.programs.compile_check.model_flops`: the teacher's rows add a block of
    ``l_ins`` latents (``ctx_tokens`` of text for ``text``) per episode, and the encoder reads
    ``n_ret`` experiences of ``exp_len`` tokens per episode."""
    episodes = rows * max(segments, 1)
    student = float(rows * seq)
    if kind in ("warmup", "grpo"):
        return PassShape(student_tokens=student)
    if kind == "text":
        return PassShape(student_tokens=student, teacher_tokens=student + episodes * ctx_tokens, teacher_backward=False)
    teacher, enc = student + episodes * l_ins, float(episodes * n_ret * exp_len)
    if kind == "cold_start":
        return PassShape(teacher_tokens=teacher, encoder_tokens=enc)
    if kind == "lopd":
        return PassShape(student_tokens=student, teacher_tokens=teacher, encoder_tokens=enc, anchor_tokens=enc)
    raise ValueError(f"unknown step {kind!r}")


__all__ = ["PassShape", "pass_collective_bytes", "step_pass_shape"]
