"""The compile check's length-aware figures: the bucketed step's shapes and the step-time estimate.

:func:`length_report` (called by :mod:`lopd_jax.compile_check`) compiles, for every
bucket of ``lengths.buckets`` (plus the cap), the largest pass the trainer can run
(:class:`train.bucketed_steps.BucketedLOPDStep`: rows per shard as
:func:`lopd_jax.length_model.plan_passes` rounds them, at most the batch's) and the update,
reports per-chip memory of the largest, and estimates the model FLOPs per real token and
the step time at 100% of the slice's peak for the ``lengths`` distribution, padded and
length-aware (:func:`lopd_jax.length_model.step_estimate`). :func:`length_lines` prints it.
"""

from __future__ import annotations

import dataclasses
import time

from lopd_jax.length_model import rows_per_pass, step_estimate

# dense bf16 peak per chip, FLOP/s (Cloud TPU spec sheets)
PEAK_FLOPS = {"v5p": 459e12, "v5e": 197e12, "v6e": 918e12, "v4": 275e12}


def _gib(x: float) -> float:
    return x / 2**30


def _memory(compiled) -> dict:
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return {"arguments": _gib(mem.argument_size_in_bytes), "outputs": _gib(mem.output_size_in_bytes),
            "aliased": _gib(mem.alias_size_in_bytes), "temporaries": _gib(mem.temp_size_in_bytes),
            "total": _gib(total)}


def shard_tokens(cfg, spec, shards: int) -> int:
    """Tokens per batch shard and pass: ``lengths.bucket_tokens``, or the padded step's
    (``steps.micro_batch`` rows, or all of a shard's rows, times the cap) -- as
    :meth:`train.run_context.RunContext.bucketed`."""
    local = max(1, spec.batch // shards)
    micro = spec.steps.micro_batch
    return cfg.lengths.bucket_tokens or (micro if 0 < micro < local else local) * spec.seq


def length_report(cfg, spec, system, gen: str, chips: int, flops_fn, compile_passes: bool = True) -> dict:
    """The length-aware figures of run config ``cfg`` (see the module docstring).

    ``system``: the compile check's abstract :class:`train.system.LOPDSystem` on the
    topology's mesh; ``flops_fn(rows, seq)``: model FLOPs of ``rows`` trajectories of
    ``seq`` tokens; ``gen``: the TPU generation (``cpu``: no time estimate).
    """
    # JAX and train/ import here: the compile check configures JAX (platform, devices) first
    from train.bucketed_steps import BucketedLOPDStep
    from train.step_spec import abstract_lopd_batch

    import jax
    import jax.numpy as jnp

    lengths = cfg.lengths
    shards = system.batch_shards(spec.batch)
    per_shard_tokens = shard_tokens(cfg, spec, shards)
    buckets = lengths.bucket_lengths(spec.seq)
    out: dict = {"buckets": list(buckets), "shard_tokens": per_shard_tokens, "batch_shards": shards,
                 "fill": lengths.fill,
                 "distribution": {k: getattr(lengths, k) for k in ("prompt_median", "prompt_sigma", "turns_mean",
                                                                    "turn_median", "turn_sigma", "first_turn_median",
                                                                    "obs_median", "obs_sigma")}}
    peak = PEAK_FLOPS.get(gen)
    est = step_estimate(lengths, flops_fn, spec.batch, spec.seq, shards, per_shard_tokens,
                        (peak or 1.0) * chips)
    if peak is None:
        for side in ("padded", "bucketed"):
            est[side].pop("seconds")
    out["estimate"] = est | {"buckets": list(est["buckets"]), "peak_flops_per_chip": peak}
    if not (compile_passes and lengths.enabled):
        return out
    state, frozen = system.abstract_state()
    step = BucketedLOPDStep(system, state)
    sds = jax.ShapeDtypeStruct
    totals = {k: sds((), jnp.float32) for k in ("tokens", "rollouts", "anchor_elements")}
    max_per_shard = 1 << (-(-spec.batch // shards) - 1).bit_length()
    passes, t0 = [], time.time()
    update_mem = None
    for seq in buckets:
        rows = min(rows_per_pass(seq, per_shard_tokens, shards) // shards, max_per_shard) * shards
        b = abstract_lopd_batch(dataclasses.replace(spec, batch=rows, seq=seq))
        b["row_valid"] = sds((rows,), jnp.float32)
        b["row_index"] = sds((rows,), jnp.int32)
        lowered_pass, lowered_update = step.lower(state, frozen, b, spec.batch, totals)
        passes.append({"rows": rows, "seq": seq, "per_chip_gib": _memory(lowered_pass.compile())})
        if update_mem is None:
            update_mem = _memory(lowered_update.compile())
    out["compile_s"] = round(time.time() - t0, 1)
    out["passes"] = passes
    out["update_per_chip_gib"] = update_mem
    out["largest"] = max(passes, key=lambda p: p["per_chip_gib"]["total"])
    return out


def memory_line(m: dict, hbm_gib: float | None, label: str = "per chip GiB") -> str:
    """The report line of a per-chip memory analysis ``m`` (GiB), against the HBM when known."""
    return (f"  {label}: arguments {m['arguments']:.2f}  outputs {m['outputs']:.2f}  aliased {m['aliased']:.2f}  "
            f"temporaries {m['temporaries']:.2f}  total {m['total']:.2f}"
            + (f"  / HBM {hbm_gib:.0f}" if hbm_gib else ""))


def length_lines(rep: dict, hbm_gib: float | None) -> list[str]:
    """The compile check's report lines of :func:`length_report`'s ``rep``."""
    lines = []
    est, d = rep["estimate"], rep["distribution"]
    if "passes" in rep:
        big = rep["largest"]
        lines.append(f"  length buckets {tuple(rep['buckets'])}, {rep['shard_tokens']} tokens per shard and pass, "
                     f"fill {rep['fill']}: compiled {len(rep['passes'])} pass shapes (rows x seq "
                     + ", ".join(f"{p['rows']}x{p['seq']}" for p in rep["passes"]) + f") + update in {rep['compile_s']} s")
        lines.append(memory_line(big["per_chip_gib"], hbm_gib, f"largest pass {big['rows']}x{big['seq']} per chip GiB"))
        lines.append(memory_line(rep["update_per_chip_gib"], hbm_gib, "update per chip GiB"))
    else:
        lines.append(f"  length buckets off (lengths.buckets=()); estimate for buckets {tuple(rep['buckets'])}")
    lines.append(f"  episode lengths: prompt median {d['prompt_median']:g} (sigma {d['prompt_sigma']:g}), turns mean "
                 f"{d['turns_mean']:g}, turn median {d['turn_median']:g} (sigma {d['turn_sigma']:g})"
                 + (f", first turn median {d['first_turn_median']:g}" if d["first_turn_median"] else "")
                 + f", observation median {d['obs_median']:g} (sigma {d['obs_sigma']:g}): mean episode "
                 f"{est['mean_length']:,.0f} tokens")
    p, b = est["padded"], est["bucketed"]
    lines.append(f"  model FLOPs/step padded {p['flops']:.3e} ({p['real_fraction']:.0%} of row tokens real), "
                 f"length-aware {b['flops']:.3e} ({b['real_fraction']:.0%} real)")
    lines.append(f"  model FLOPs per real token: padded {p['flops_per_real_token']:.3e}, "
                 f"length-aware {b['flops_per_real_token']:.3e}")
    if "seconds" in p:
        lines.append(f"  est. step time at 100% peak ({est['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s per chip): "
                     f"padded {p['seconds']:.1f} s, length-aware {b['seconds']:.1f} s "
                     f"({p['seconds'] / b['seconds']:.2f}x)")
    return lines


__all__ = ["PEAK_FLOPS", "shard_tokens", "length_report", "length_lines"]
