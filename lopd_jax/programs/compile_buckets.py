"""The compile check's length-aware figures: every training step's pass shapes and step estimate.

:func:`stage_steps` names the steps a run config trains with: the warm-up (SFT, when
``stages.warmup_steps`` > 0), the composer cold start (composer arms with
``stages.cold_start_steps`` > 0) and the arm's step (LOPD, GRPO or text distillation).
:func:`length_report` (called by :mod:`lopd_jax.compile_check` per step) compiles, for every
row length of ``lengths.buckets`` (plus the cap), the largest pass the trainer can run (the
step's :mod:`train.bucketed_steps` class; with ``lengths.packing`` a packed pass,
:func:`abstract_packed_pass`) and the update, reports per-chip memory of the largest, and
estimates padded, bucketed and packed: the real share of row tokens, FLOPs per real token
and the step time at 100% of the slice's peak for the ``lengths`` distribution
(:func:`lopd_jax.planning.length_estimate.step_estimate`). :func:`length_lines` prints it."""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from lopd_jax.settings.arm_config import arm_spec
from lopd_jax.planning.collective_estimate import pass_collective_bytes, step_pass_shape
from lopd_jax.planning.length_estimate import step_estimate
from train.packed_batches import model_attention_length
from lopd_jax.planning.length_model import rows_per_pass
from train.arms.registry import arm_class, arm_classes
from train.bucketed_steps import SEQ_KEYS, BucketedBatch, BucketedColdStartStep
from train.step_spec import abstract_lopd_batch
from train.warmup import BucketedSFTStep, make_sft_step

# dense bf16 peak per chip, FLOP/s (Cloud TPU spec sheets)
PEAK_FLOPS = {"v5p": 459e12, "v5e": 197e12, "v6e": 918e12, "v4": 275e12}
HBM_BANDWIDTH = {"v5p": 2.76e12, "v5e": 0.819e12, "v6e": 1.64e12, "v4": 1.2e12}  # bytes/s per chip
ICI_BANDWIDTH = {"v5p": 600e9, "v5e": 200e9, "v6e": 448e9, "v4": 300e9}  # bytes/s per chip (4,800 Gbps on v5p)
STEP_KINDS = ("warmup", "cold_start", "lopd", "grpo", "text")
STEP_NAMES = {"warmup": "warm-up (SFT)", "cold_start": "cold start", "lopd": "LOPD", "grpo": "GRPO",
              "text": "text distillation"}


def _gib(x: float) -> float:
    return x / 2**30


def _memory(compiled) -> dict:
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return {"arguments": _gib(mem.argument_size_in_bytes), "outputs": _gib(mem.output_size_in_bytes),
            "aliased": _gib(mem.alias_size_in_bytes), "temporaries": _gib(mem.temp_size_in_bytes),
            "total": _gib(total)}


def stage_steps(cfg) -> list[str]:
    """The training steps run config ``cfg`` runs, in order (of :data:`STEP_KINDS`): ``warmup``
    when ``stages.warmup_steps`` > 0, ``cold_start`` when the arm uses the composer and
    ``stages.cold_start_steps`` > 0, then the arm's step (``Arm.step_kind``: ``lopd``, ``grpo``
    or ``text``). An unregistered arm is a ConfigError that lists the registered arms."""
    step = arm_class(cfg.arm).step_kind
    steps = ["warmup"] if cfg.stages.warmup_steps > 0 else []
    if arm_spec(cfg.arm).composer and cfg.stages.cold_start_steps > 0:
        steps.append("cold_start")
    return steps + [step]


def step_rows(cfg, spec, kind: str, shards: int) -> int:
    """Rows of one ``kind`` step's batch: the warm-up's and cold start's batch sizes, else the
    rollouts per step; rounded up to a multiple of the batch shards (as the trainer pads)."""
    n = {"warmup": cfg.stages.warmup_batch, "cold_start": cfg.stages.cold_start_batch}.get(kind, spec.batch)
    return -(-n // shards) * shards


def shard_tokens(cfg, spec, shards: int, rows: int | None = None) -> int:
    """Tokens per batch shard and pass: ``lengths.bucket_tokens``, or the padded step's
    (``steps.micro_batch`` rows, or all of a shard's rows, times the cap) for a batch of
    ``rows`` (default the rollouts per step) -- as :meth:`train.run_context.RunContext.bucketed`."""
    local = max(1, (spec.batch if rows is None else rows) // shards)
    micro = spec.steps.micro_batch
    return cfg.lengths.bucket_tokens or (micro if 0 < micro < local else local) * spec.seq


def _abstract_pass(cfg, spec, kind: str, rows: int, seq: int) -> dict:
    """``jax.ShapeDtypeStruct`` s of one pass of ``rows`` x ``seq`` of a ``kind`` step (the
    keys the trainer's batches of that stage carry, plus ``row_valid`` / ``row_index``)."""

    sds = jax.ShapeDtypeStruct
    b = abstract_lopd_batch(dataclasses.replace(spec, batch=rows, seq=seq))
    seq_keys = {k: b[k] for k in ("tokens", "attention_mask", "loss_mask")}
    if kind == "warmup":
        b = seq_keys
    elif kind == "cold_start":  # the cold start trains on successes: no rewards, no behaviour log-probs
        b.pop("rewards")
        b.pop("old_logp", None)
    elif kind == "grpo":
        b = seq_keys | {"rewards": b["rewards"], "old_logp": sds((rows, seq), jnp.float32),
                        "advantages": sds((rows,), jnp.float32)}
    elif kind == "text":
        b = seq_keys | {"insert_at": b["insert_at"], "rewards": b["rewards"], "old_logp": sds((rows, seq), jnp.float32),
                        "ctx_ids": sds((rows, cfg.arms.context_tokens), jnp.int32), "ctx_len": sds((rows,), jnp.int32),
                        "row_weight": sds((rows,), jnp.float32)}
    return b | {"row_valid": sds((rows,), jnp.float32), "row_index": sds((rows,), jnp.int32)}


def block_width(cfg, system, kind: str) -> int:
    """Tokens of the block a packed ``kind`` step's teacher inserts per segment: the latent
    block (LOPD, cold start), the text context (``arms.context_tokens``), else 0."""
    return {"lopd": system.layout.length, "cold_start": system.layout.length,
            "text": cfg.arms.context_tokens}.get(kind, 0)


def abstract_packed_pass(cfg, spec, kind: str, rows: int, seq: int, segments: int, width: int) -> dict:
    """``jax.ShapeDtypeStruct`` s of one packed pass (:func:`train.packed_batches.packed_batch`)
    of a ``kind`` step: ``rows`` packed rows of ``seq`` tokens with up to ``segments``
    episodes each; a teacher block of ``width`` tokens per segment (0: no teacher rows)."""
    sds = jax.ShapeDtypeStruct
    out = {}
    for k, v in _abstract_pass(cfg, spec, kind, rows, seq).items():
        if k in SEQ_KEYS:
            out[k] = v
        elif k not in ("insert_at", "ctx_ids", "ctx_len"):  # per episode: [P, K, ...]
            out[k] = sds((rows, segments) + v.shape[1:], v.dtype)
    out |= {"segment_ids": sds((rows, seq), jnp.int32), "unpack_index": sds((rows, segments, seq), jnp.int32)}
    if width:
        row = (rows, seq + segments * width)
        out |= {"teacher_tokens": sds(row, jnp.int32), "teacher_segment_ids": sds(row, jnp.int32),
                "teacher_attention_mask": sds(row, jnp.bool_), "teacher_align": sds((rows, seq), jnp.int32)}
        if kind in ("lopd", "cold_start"):
            out["teacher_slot"] = sds(row, jnp.int32)
    return out


def _bucketed_step(cfg, system, kind: str):
    """``(step, abstract state, abstract second argument)`` of the ``kind`` bucketed step."""

    state, frozen = system.abstract_state(cfg.seed)
    arm = arm_class(cfg.arm)
    if kind != arm.step_kind:  # --steps names another arm's step: the first registered arm with it
        arm = next((a for a in arm_classes().values() if a.step_kind == kind), None)
    if arm is not None:  # the arm's step on its state (SDFT adds ``ema``)
        state = arm.add_state(cfg, state)
        return arm.bucketed_step(cfg, system, state), state, frozen
    if kind == "cold_start":
        cold = jax.eval_shape(lambda c, rng: {"step": jnp.zeros((), jnp.int32), "rng": rng, "composer": c,
                                              "composer_opt": {k: system.cold_start_opt[k].init(c[k]) for k in c}},
                              state["composer"], state["rng"])
        return BucketedColdStartStep(system, cold), cold, frozen
    opt, _ = make_sft_step(system, cfg.stages)
    warm = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p, "opt": opt.init(p)}, frozen)
    return BucketedSFTStep(system, warm, opt), warm, state["composer"]["lora"]


def collectives_fn(cfg, spec, system, kind: str, ici: float):
    """``collectives(rows, seq, segments)``: seconds one pass of the ``kind`` step spends in ICI
    collectives on ``system``'s mesh at ``ici`` bytes/s per chip, not overlapped
    (:mod:`lopd_jax.planning.collective_estimate`)."""
    m = spec.model
    layer_params = m.num_layers * m.layer_matmul_params()
    mesh = dict(system.rules.mesh.shape) if system.rules is not None else {}
    width = {"bfloat16": 2, "float16": 2}
    fixed = dict(hidden=m.hidden_size, layers=m.num_layers, layer_params=layer_params,
                 head_params=m.hidden_size * m.vocab_size, data=mesh.get("data", 1), fsdp=mesh.get("fsdp", 1),
                 tensor=mesh.get("tensor", 1), remat=m.remat_policy == "full", act_bytes=width.get(m.dtype, 4),
                 param_bytes=width.get(m.param_dtype, 4))

    def seconds(rows: int, seq: int, segments: int = 0) -> float:
        shape = step_pass_shape(kind, rows, seq, n_ret=spec.composer.n_ret, exp_len=spec.exp_len,
                                l_ins=system.layout.length, ctx_tokens=cfg.arms.context_tokens, segments=segments)
        return pass_collective_bytes(shape, **fixed)["total"] / ici
    return seconds


def length_report(cfg, spec, system, gen: str, chips: int, flops_fn, compile_passes: bool = True,
                  kind: str = "lopd", largest_only: bool = False) -> dict:
    """The length-aware figures of the ``kind`` step (:data:`STEP_KINDS`) of run config ``cfg``
    (see the module docstring). ``largest_only``: compile only the pass of the longest rows
    (the largest; minutes instead of an hour for an 8B model on a small host).

    ``system``: the compile check's abstract :class:`train.system.LOPDSystem` on the
    topology's mesh; ``flops_fn(rows, seq, segments=0, segment_lengths=None)``: FLOPs of
    the step on ``rows`` rows of ``seq`` tokens, one trajectory each, or packed
    (:func:`lopd_jax.programs.compile_check.step_flops_fn`); ``gen``: the TPU generation
    (``cpu``: no time estimate). With ``lengths.packing`` the compiled passes are packed.
    """

    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step {kind!r}; choose from {STEP_KINDS}")
    lengths = cfg.lengths
    shards = system.batch_shards(spec.batch)
    rows = step_rows(cfg, spec, kind, shards)
    per_shard_tokens = shard_tokens(cfg, spec, shards, rows)
    buckets = lengths.bucket_lengths(spec.seq)
    out: dict = {"step": kind, "rows": rows, "buckets": list(buckets), "shard_tokens": per_shard_tokens,
                 "batch_shards": shards, "fill": lengths.fill, "packing": lengths.packing,
                 "mesh": dict(system.rules.mesh.shape) if system.rules is not None else {"data": 1, "fsdp": 1, "tensor": 1},
                 "distribution": {k: getattr(lengths, k) for k in ("prompt_median", "prompt_sigma", "turns_mean",
                                                                    "turn_median", "turn_sigma", "first_turn_median",
                                                                    "obs_median", "obs_sigma")}}
    peak, ici = PEAK_FLOPS.get(gen), ICI_BANDWIDTH.get(gen)
    micro = spec.steps.micro_batch
    est = step_estimate(lengths, flops_fn, rows, spec.seq, shards, per_shard_tokens, (peak or 1.0) * chips,
                        attention_length=model_attention_length(system.model_cfg),
                        collectives=None if ici is None else collectives_fn(cfg, spec, system, kind, ici),
                        padded_passes=max(1, rows // shards // micro) if micro else 1,
                        kernel_skips=system.model_cfg.attention_impl == "splash")
    if peak is None:
        for side in ("padded", "bucketed", "packed"):
            est[side].pop("seconds")
            est[side].pop("seconds_with_collectives", None)
    out["estimate"] = est | {"buckets": list(est["buckets"]), "peak_flops_per_chip": peak}
    if not (compile_passes and lengths.enabled):
        out["not_compiled"] = ("passes not compiled" if lengths.enabled else
                               "length buckets and packing off (lengths.buckets=(), lengths.packing=false)")
        return out
    step, state, second = _bucketed_step(cfg, system, kind)
    sds = jax.ShapeDtypeStruct
    stats = {k: 0.0 for k in ("mean_reward", "tokens", "supervised", "rollouts", "weight")} | {"rows": rows}
    totals = jax.tree.map(lambda x: sds(x.shape, x.dtype), step._totals(BucketedBatch([], [], rows, stats)))
    max_per_shard = 1 << (-(-rows // shards) - 1).bit_length()
    seen = est["packed"]["segments"]
    passes, t0 = [], time.time()
    update_mem = None
    for seq in reversed(buckets):  # longest first: the likely largest pass is known first on a long compile
        fits = rows_per_pass(seq, per_shard_tokens, shards) // shards
        if lengths.packing:  # the packing plan's rows per shard are powers of two
            n = min(1 << (fits.bit_length() - 1), max_per_shard) * shards
            # episodes per row: the most any sampled plan put in a row of this length
            k = seen.get(seq, max(seen.values()))
            abstract = abstract_packed_pass(cfg, spec, kind, n, seq, k, block_width(cfg, system, kind))
        else:
            n, k = min(fits, max_per_shard) * shards, 0
            abstract = _abstract_pass(cfg, spec, kind, n, seq)
        lowered_pass, lowered_update = step.lower(state, second, abstract, rows, totals)
        passes.append({"rows": n, "seq": seq, "per_chip_gib": _memory(lowered_pass.compile())}
                      | ({"segments": k} if k else {}))
        # progress on stderr: a real-size compile takes minutes per pass
        print(f"  [{STEP_NAMES[kind]}] compiled {_shape(passes[-1])} pass: {passes[-1]['per_chip_gib']['total']:.2f} "
              f"GiB per chip ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        if update_mem is None:
            update_mem = _memory(lowered_update.compile())
        if largest_only:
            break
    out["compile_s"] = round(time.time() - t0, 1)
    out["passes"] = passes[::-1]
    out["update_per_chip_gib"] = update_mem
    out["largest"] = max(passes, key=lambda p: p["per_chip_gib"]["total"])
    return out


def executed_how(est: dict) -> str:
    """How the estimate counts executed attention: the splash kernel skips the blocks outside
    each row's trajectories; the other kernels run every causal block of a row."""
    return ("block by block within trajectories (splash skips the rest)" if est.get("kernel_skips")
            else "over whole rows")


def _shape(p: dict) -> str:
    """A compiled pass's shape: rows x seq, and x segments when packed."""
    return f"{p['rows']}x{p['seq']}" + (f"x{p['segments']}" if "segments" in p else "")


def memory_line(m: dict, hbm_gib: float | None, label: str = "per chip GiB") -> str:
    """The report line of a per-chip memory analysis ``m`` (GiB), against the HBM when known."""
    return (f"  {label}: arguments {m['arguments']:.2f}  outputs {m['outputs']:.2f}  aliased {m['aliased']:.2f}  "
            f"temporaries {m['temporaries']:.2f}  total {m['total']:.2f}"
            + (f"  / HBM {hbm_gib:.0f}" if hbm_gib else ""))


def distribution_line(rep: dict) -> str:
    """The report line of the episode-length distribution of a :func:`length_report`."""
    d, est = rep["distribution"], rep["estimate"]
    return (f"  episode lengths: prompt median {d['prompt_median']:g} (sigma {d['prompt_sigma']:g}), turns mean "
            f"{d['turns_mean']:g}, turn median {d['turn_median']:g} (sigma {d['turn_sigma']:g})"
            + (f", first turn median {d['first_turn_median']:g}" if d["first_turn_median"] else "")
            + f", observation median {d['obs_median']:g} (sigma {d['obs_sigma']:g}): mean episode "
            f"{est['mean_length']:,.0f} tokens")


def length_lines(rep: dict, hbm_gib: float | None) -> list[str]:
    """The compile check's report lines of :func:`length_report`'s ``rep`` (one step)."""
    est = rep["estimate"]
    lines = [f"  {STEP_NAMES[rep['step']]} step, {rep['rows']} rows per batch:"]
    if "passes" in rep:
        big = rep["largest"]
        what = ("packed rows of " if rep["packing"] else "length buckets ") + str(tuple(rep["buckets"]))
        lines.append(f"    {what}, {rep['shard_tokens']} tokens per shard and pass"
                     + ("" if rep["packing"] else f", fill {rep['fill']}") + f": compiled {len(rep['passes'])} "
                     + ("packed pass shapes (rows x seq x segments " if rep["packing"] else "pass shapes (rows x seq ")
                     + ", ".join(_shape(p) for p in rep["passes"]) + f") + update in {rep['compile_s']} s")
        lines.append("  " + memory_line(big["per_chip_gib"], hbm_gib, f"largest pass {_shape(big)} per chip GiB"))
        lines.append("  " + memory_line(rep["update_per_chip_gib"], hbm_gib, "update per chip GiB"))
    else:
        lines.append(f"    {rep['not_compiled']}: estimate for rows of {tuple(rep['buckets'])}")
    p, b, k = est["padded"], est["bucketed"], est["packed"]
    lines.append(f"    real share of row tokens: padded {p['real_fraction']:.0%}, bucketed {b['real_fraction']:.0%}, "
                 f"packed {k['real_fraction']:.0%} (trajectories per packed row: up to {max(k['segments'].values())})")
    lines.append(f"    model FLOPs/step: padded {p['flops']:.3e}, bucketed {b['flops']:.3e}, packed {k['flops']:.3e} "
                 f"(attention within trajectories; executed {executed_how(est)}: padded {p['executed_flops']:.3e}, "
                 f"bucketed {b['executed_flops']:.3e}, packed {k['executed_flops']:.3e})")
    lines.append(f"    model FLOPs per real token: padded {p['flops_per_real_token']:.3e}, bucketed "
                 f"{b['flops_per_real_token']:.3e}, packed {k['flops_per_real_token']:.3e} (executed "
                 f"{p['executed_flops_per_real_token']:.3e}, {b['executed_flops_per_real_token']:.3e}, "
                 f"{k['executed_flops_per_real_token']:.3e})")
    if "seconds" in p:
        lines.append(f"    est. step time at 100% peak ({est['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s per chip) from "
                     f"executed FLOPs: padded {p['seconds']:.1f} s, bucketed {b['seconds']:.1f} s, packed "
                     f"{k['seconds']:.1f} s (padded/packed {p['seconds'] / k['seconds']:.2f}x, bucketed/packed "
                     f"{b['seconds'] / k['seconds']:.2f}x)")
    if "seconds_with_collectives" in p:
        lines.append(f"    + ICI collectives, not overlapped (mesh data={rep['mesh']['data']} fsdp={rep['mesh']['fsdp']} "
                     f"tensor={rep['mesh']['tensor']}): padded {p['collective_seconds']:.1f} s, bucketed "
                     f"{b['collective_seconds']:.1f} s, packed {k['collective_seconds']:.1f} s -> padded "
                     f"{p['seconds_with_collectives']:.1f} s, bucketed {b['seconds_with_collectives']:.1f} s, packed "
                     f"{k['seconds_with_collectives']:.1f} s")
    return lines


__all__ = ["HBM_BANDWIDTH", "ICI_BANDWIDTH", "PEAK_FLOPS", "STEP_KINDS", "STEP_NAMES", "stage_steps", "step_rows",
           "shard_tokens", "block_width", "collectives_fn", "abstract_packed_pass", "length_report", "memory_line", "distribution_line",
           "length_lines"]
