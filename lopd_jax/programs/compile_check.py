"""Ahead-of-time compile of a run config's LOPD step for a TPU topology, on a CPU host.

    python -m lopd_jax.compile_check --config=qwen3_8b --topology=v5p-32 [dotted.key=value ...]

Compiles exactly the step ``python -m lopd_jax.train --config=NAME`` runs (attention, micro-batching,
mesh, sharding rules, dtypes, remat and lengths from :func:`train.step_spec.step_spec`), with JAX's
AOT path (``libtpu``, no chips), abstract shapes and no weights; ``--topology=cpu:8`` uses
simulated CPU devices. Prints per-chip memory against HBM and model FLOPs per step, then each
training step's largest length-bucketed (or, ``lengths.packing=true``, packed) pass and the
padded / bucketed / packed estimate (:mod:`lopd_jax.programs.compile_buckets`);
``--estimate_only`` compiles nothing and prints the estimate; ``--flops`` also counts
compiled FLOPs. Overrides are the trainer's dotted keys; ``--rule`` remaps one logical axis.

Exit status (:data:`EXIT_CODES`): 0 fits, 1 does not fit in HBM, 2 bad arguments or config
or a missing file, 3 cannot compile here (no ``libtpu``: ``make tpu``). Details:
``docs/results.md``, "Compile check".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pkgutil
import re
import sys
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

import configs
from lopd_jax.chat.tokenizers import tiny_tokenizer
from lopd_jax.envs.registry import get_task_source
from lopd_jax.method.composer import make_compressor
from lopd_jax.method.losses_kl import unroll_scans
from lopd_jax.programs.launcher import EXIT_USER_ERROR, USER_ERROR_EXITS, exit_on_error
from lopd_jax.programs.compile_buckets import (STEP_KINDS, distribution_line, length_lines, length_report, memory_line,
                                     stage_steps)
from configs import load_config
from lopd_jax.settings.overrides import apply_overrides
from models.decoder import Decoder
from models.partitioning import DEFAULT_RULES
from models.splash import _block, segment_block_keep
from train import mesh as mesh_lib
from train.run_context import run_tokenizer
from train.step_spec import abstract_lopd_batch, splice_layout, step_spec
from train.steps import make_lopd_step
from train.system import LOPDSystem

HBM_GIB = {"v5e": 16.0, "v5p": 95.0, "v6e": 32.0, "v4": 32.0}
# chips per "name-N": v5p and v4 count TensorCores (2 per chip); v5e / v6e count chips.
CORES_PER_CHIP = {"v5p": 2, "v4": 2, "v5e": 1, "v6e": 1}
TOPOLOGY_SHAPES = {  # chips -> physical topology
    "v5p": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"},
    "v4": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
}


EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_ARGS, EXIT_CANNOT_COMPILE = 0, 1, EXIT_USER_ERROR, 3
EXIT_CODES = {EXIT_FITS: "the step fits (or --dry_run resolved everything)",
              EXIT_DOES_NOT_FIT: "the step does not fit in the topology's HBM",
              EXIT_BAD_ARGS: "bad arguments or config (unknown topology, key or value), or a missing file",
              EXIT_CANNOT_COMPILE: "cannot compile here: no libtpu for a TPU topology (make tpu), or JAX lacks "
                                   "jax.experimental.topologies"}


class CannotCompileHere(RuntimeError):
    """This host cannot compile for the asked topology (libtpu or JAX's topology API missing)."""


# the compile checks' errors -> exit status: the programs' user errors (2), and 3 for a host
# that cannot compile for the topology
ERROR_EXITS = {**USER_ERROR_EXITS, CannotCompileHere: EXIT_CANNOT_COMPILE}


def known_topologies() -> list[str]:
    """Every TPU topology name ``--topology`` accepts (``v5p-32``, ``v5e-64``, ...)."""
    return [f"{g}-{c * CORES_PER_CHIP[g]}" for g in TOPOLOGY_SHAPES for c in TOPOLOGY_SHAPES[g]]


def topology_devices(topology: str):
    """Devices for ``v5p-32`` style TPU names (AOT, no chips) or ``cpu:N``; returns (devices, kind, hbm).
    ValueError names an unknown topology; :class:`CannotCompileHere` a host without libtpu."""

    if topology.startswith("cpu:"):
        count = topology.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"unknown topology {topology!r}: cpu:N needs a device count N >= 1, e.g. cpu:8")
        n = int(count)
        devs = jax.devices("cpu")
        if len(devs) < n:  # the command line (lopd_jax.compile_check) sets the flag first
            raise ValueError(f"--topology={topology} needs {n} CPU devices but JAX started with {len(devs)}; "
                             f"start the process with XLA_FLAGS=--xla_force_host_platform_device_count={n}")
        return devs[:n], "cpu", None
    if topology not in known_topologies():  # exact names: v5p-33 is no 16-chip slice
        raise ValueError(f"unknown topology {topology!r}; known: {', '.join(known_topologies())}, cpu:N")
    gen, count = topology.split("-")
    shape = TOPOLOGY_SHAPES[gen][int(count) // CORES_PER_CHIP[gen]]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chips: nothing to lock
    try:
        from jax.experimental import topologies  # TPU topologies only; some jax builds lack it
    except ImportError as e:  # pragma: no cover
        raise CannotCompileHere(f"jax.experimental.topologies unavailable in this JAX build: {e}") from None
    name = {"v5e": "v5e", "v6e": "v6e", "v5p": "v5p", "v4": "v4"}[gen]
    dims = [int(x) for x in shape.split("x")]
    bounds = (min(dims[0], 2), min(dims[1], 2), 1)  # hosts of up to 2x2 chips
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{name}:{shape}",
                                            chip_config_name="default", chips_per_host_bounds=bounds,
                                            num_slices=1)
    except Exception as e:
        raise CannotCompileHere(f"could not build the {topology} topology ({e}). Install libtpu for this JAX: "
                                f"pip install -c constraints.txt -e \".[tpu]\" (make tpu), or check on "
                                "simulated CPU devices with --topology=cpu:N") from None
    return list(desc.devices), gen, HBM_GIB[gen]


@functools.lru_cache(maxsize=None)
def kernel_block_pairs(layout: tuple[int, ...], row_len: int, block: int) -> tuple[int, int]:
    """``(pairs, b)``: the causal (query block, key block) pairs the splash kernel runs on a
    row of ``row_len`` tokens holding segments of ``layout`` lengths back to back (padding
    after), in blocks of ``b`` (``block`` capped at the row), cross-segment blocks skipped
    as :func:`models.splash.segment_block_keep` decides."""
    b = _block(row_len, block)
    n = -(-row_len // b)
    seg = np.zeros(n * b, np.int32)
    seg[:sum(layout)] = np.repeat(np.arange(1, len(layout) + 1), layout)
    return int(np.tril(segment_block_keep(seg, b, xp=np)).sum()), b


def model_flops(mcfg, ccfg, batch: int, seq: int, exp_len: int, l_ins: int, segments: int = 0,
                segment_lengths: Sequence[int] | None = None,
                row_layouts: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """Analytic FLOPs of one LOPD step (matmuls; causal attention counted at half).

    student fwd+bwd (weights and activations): 6 N T; teacher fwd + activation backward:
    4 N T_t; encoder fwd + activation/LoRA backward 4 N T_e (+ anchor forward 2 N T_e);
    LM heads over the supervised sequence for both models.

    Packed rows (``segments`` K > 0): ``batch`` rows of ``seq`` tokens holding up to K
    episodes each; the teacher's rows are ``seq + K * l_ins`` long (a block per segment) and
    the encoder reads ``batch * K`` episodes' experiences. Attention runs over whole rows
    (every causal block of a row), or, given ``segment_lengths`` (the episodes' tokens),
    within the segments only (the model's).

    ``row_layouts`` (each row's episode lengths, in order; one per row when unpacked):
    attention as the splash kernel executes it, whole ``mcfg.attention_block_q`` blocks
    within the segments and the padding's diagonal blocks (:func:`kernel_block_pairs`).
    """
    d, L, H, hd = mcfg.hidden_size, mcfg.num_layers, mcfg.num_heads, mcfg.head_dim
    n_layer = L * mcfg.layer_matmul_params()
    head = d * mcfg.vocab_size

    def attn(tokens_per_seq, n_seq):
        return 2 * 2 * n_seq * tokens_per_seq ** 2 * H * hd * L / 2  # QK^T and PV, causal

    if segments:
        t_row = seq + segments * l_ins
        t_s, t_t, n_exp = batch * seq, batch * t_row, batch * segments * ccfg.n_ret
        if segment_lengths is None:
            a_s, a_t = attn(seq, batch), attn(t_row, batch)
        else:
            a_s = sum(attn(n, 1) for n in segment_lengths)
            a_t = sum(attn(n + l_ins, 1) for n in segment_lengths)
    else:
        t_s, t_t, n_exp = batch * seq, batch * (seq + l_ins), batch * ccfg.n_ret
        a_s, a_t = attn(seq, batch), attn(seq + l_ins, batch)
    if row_layouts is not None:
        if len(row_layouts) != batch:
            raise ValueError(f"row_layouts has {len(row_layouts)} rows for a batch of {batch}")
        t_row = seq + (segments or 1) * l_ins

        def kernel_attn(layout, row_len):
            pairs, b = kernel_block_pairs(tuple(int(n) for n in layout), row_len, mcfg.attention_block_q)
            return 2 * 2 * pairs * b * b * H * hd * L
        a_s = sum(kernel_attn(lay, seq) for lay in row_layouts)
        a_t = sum(kernel_attn([n + l_ins for n in lay], t_row) for lay in row_layouts)
    t_e = n_exp * exp_len
    student = 6 * n_layer * t_s + 3 * a_s + 6 * head * t_s
    teacher = 4 * n_layer * t_t + 2 * a_t + 4 * head * t_s
    anchor = 2 * n_layer * t_e + attn(exp_len, n_exp)
    encoder = 4 * n_layer * t_e + 2 * attn(exp_len, n_exp) + anchor
    return {"student": student, "teacher": teacher, "encoder": encoder, "anchor": anchor,
            "total": student + teacher + encoder}


def step_flops(kind: str, mcfg, ccfg, batch: int, seq: int, exp_len: int, l_ins: int, ctx_tokens: int = 0,
               segments: int = 0, segment_lengths: Sequence[int] | None = None,
               row_layouts: Sequence[Sequence[int]] | None = None) -> float:
    """Analytic FLOPs of one training step of ``kind`` (:data:`lopd_jax.programs.compile_buckets.STEP_KINDS`)
    from :func:`model_flops`' parts: ``lopd`` all of them; ``warmup`` and ``grpo`` the
    student's fwd + bwd; ``cold_start`` the teacher (latents spliced; fwd + activation
    backward into the composer) and the encoder without the anchor; ``text`` the student
    and the teacher's forward over the sequence plus a ``ctx_tokens`` context block.
    ``segments`` / ``segment_lengths`` / ``row_layouts``: as for :func:`model_flops`."""
    packing = {"segments": segments, "segment_lengths": segment_lengths, "row_layouts": row_layouts}
    f = model_flops(mcfg, ccfg, batch, seq, exp_len, l_ins, **packing)
    if kind == "lopd":
        return f["total"]
    if kind in ("warmup", "grpo"):
        return f["student"]
    if kind == "cold_start":
        return f["teacher"] + f["encoder"] - f["anchor"]
    if kind == "text":
        return f["student"] + model_flops(mcfg, ccfg, batch, seq, exp_len, ctx_tokens, **packing)["teacher"] / 2
    raise ValueError(f"unknown step {kind!r}")


def step_flops_fn(kind: str, cfg, spec, system):
    """``flops(rows, seq, segments=0, segment_lengths=None, row_layouts=None)``: :func:`step_flops` of the
    ``kind`` step of run config ``cfg`` (its experience length, latent block, context
    block), the argument :func:`lopd_jax.programs.compile_buckets.length_report` takes."""
    def flops(rows: int, seq: int, segments: int = 0, segment_lengths: Sequence[int] | None = None,
              row_layouts: Sequence[Sequence[int]] | None = None) -> float:
        return step_flops(kind, spec.model, spec.composer, rows, seq, spec.exp_len, system.layout.length,
                          cfg.arms.context_tokens, segments, segment_lengths, row_layouts)
    return flops


def build_system(spec, layout, devices):
    """The abstract :class:`train.system.LOPDSystem` of ``spec`` on a mesh of ``devices`` (no weights)."""

    mesh = mesh_lib.make_mesh(spec.mesh, devices)
    rules = mesh_lib.rules_for(mesh, spec.mesh)
    backbone = nnx.eval_shape(lambda: Decoder(spec.model, rngs=nnx.Rngs(0), rules=rules))
    compressor = nnx.eval_shape(lambda: make_compressor(spec.model, spec.composer, nnx.Rngs(0)))
    return LOPDSystem(backbone, compressor, spec.composer, layout, spec.steps, rules)


def build_step(spec, layout, devices):
    """(compiled, system) for the LOPD step of ``spec`` lowered on ``devices`` with abstract inputs."""

    system = build_system(spec, layout, devices)
    state, frozen = system.abstract_state()
    b = abstract_lopd_batch(spec)
    step = make_lopd_step(system, state, b)
    compiled = step.lower(state, frozen, b).compile()
    return compiled, system


_SPLASH_CALL = re.compile(r"^\s*%splash_mha_(fwd|dq|dkv)\S* = \((.*?)\) custom-call\(", re.M)
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def splash_kernel_flops(hlo_text: str, block: int, q_per_kv: int) -> float:
    """FLOPs the splash custom calls of a compiled (per-chip) HLO module execute.

    Each call's first bf16/f32 rank >= 3 output is q-shaped ``[..., H, S, hd]`` (fwd, dq) or
    kv-shaped ``[..., KV, S, hd]`` (dkv; H = KV * ``q_per_kv``). Causal masks: with
    b the kernel block for S (``block`` capped at S) and n = S / b, n (n + 1) / 2 blocks are
    computed, each costing 2 * b^2 * hd per matmul and head. The blocks a row's segments
    skip at run time (:mod:`models.splash`) are not known here: this is their upper bound.
    """

    total = 0.0
    for phase, outs in _SPLASH_CALL.findall(hlo_text):
        shapes = [[int(d) for d in m.split(",")] for m in re.findall(r"(?:bf16|f32|f16)\[([\d,]+)\]", outs)]
        shape = next(sh for sh in shapes if len(sh) >= 3)
        lead = 1
        for d in shape[:-3]:
            lead *= d
        heads, seq, hd = shape[-3:]
        if phase == "dkv":
            heads *= q_per_kv
        b = _block(seq, block)
        n = -(-seq // b)
        total += lead * heads * n * (n + 1) / 2 * _SPLASH_MATMULS[phase] * 2 * b * b * hd
    return total


def rules_with(rules, overrides) -> tuple:
    """``rules`` (logical axis -> mesh axes) with ``name=axis[+axis]`` overrides (``none`` = replicated)."""
    table = dict(rules)
    for item in overrides or ():
        name, _, axes = item.partition("=")
        if name not in table or not axes:
            raise ValueError(f"--rule {item!r}: use LOGICAL=AXIS with LOGICAL one of {sorted(table)}")
        parts = tuple(a for a in axes.split("+") if a)
        table[name] = None if axes == "none" else (parts[0] if len(parts) == 1 else parts)
    return tuple(table.items())


def run_config(args):
    """The :class:`lopd_jax.settings.config.TrainConfig` the check compiles: ``configs/<args.config>.py``
    with the dotted overrides and ``--rule`` remaps applied; ConfigError on problems."""

    cfg = apply_overrides(load_config(args.config), args.overrides)
    if args.rule:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rules=rules_with(cfg.mesh.rules, args.rule)))
    return cfg


def step_inputs(cfg):
    """``(StepSpec, SpliceLayout)`` of ``cfg``: what the trainer's
    :class:`train.run_context.RunContext` builds its LOPD step from (same functions, same tokenizer)."""

    spec = step_spec(cfg)

    def source():
        return get_task_source(cfg.env.source, **cfg.env.kwargs)

    tokenizer = placeholder_tokenizer(cfg, spec.model.family) or run_tokenizer(cfg, spec.model.family, source)
    return spec, splice_layout(cfg, spec.model.family, tokenizer)[2]


BUILTIN_TOKENIZER_FAMILIES = ("qwen3",)


def placeholder_tokenizer(cfg, family: str):
    """For a config with no checkpoint (``model.hf_path``) whose family has no built-in
    tokenizer (Olmo-3): the tiny tokenizer of that chat family, else None.

    The step's shapes do not depend on it (the vocabulary is the architecture's); it only
    spells the latent block's framing text, whose token count may differ from the real
    tokenizer's by a few tokens (a ~0.1% change of the teacher's sequence). The check says so.
    """
    m = cfg.model
    if m.hf_path or m.tokenizer != "auto" or family in BUILTIN_TOKENIZER_FAMILIES or (m.name or "").startswith("tiny"):
        return None
    print(f"note: no built-in {family} tokenizer and no model.hf_path: the latent block's framing is spelled "
          f"with the tiny {family} tokenizer (its length may differ by a few tokens; the vocabulary is the "
          f"architecture's). Give model.hf_path for the exact layout.", file=sys.stderr)
    return tiny_tokenizer(family)


def _gib(x):
    return x / 2**30


def selected_steps(cfg, names: str | None) -> list[str]:
    """The steps to compile: ``--steps`` (comma-separated :data:`STEP_KINDS`), or every
    training step ``cfg`` runs (:func:`lopd_jax.programs.compile_buckets.stage_steps`)."""
    if not names:
        return stage_steps(cfg)
    steps = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in steps if n not in STEP_KINDS]
    if bad or not steps:
        raise ValueError(f"--steps={names!r}: choose from {', '.join(STEP_KINDS)} (comma-separated)")
    return steps


def _padded_lopd(args, head, spec, layout, devices, hbm):
    """``(report, system)``: ``head`` with the padded LOPD step's compile time, per-chip memory
    and FLOPs (``--flops``: compiled too); on a program XLA refuses for HBM, system None."""
    mcfg, ccfg = spec.model, spec.composer
    t0 = time.time()
    try:
        compiled, system = build_step(spec, layout, devices)
    except Exception as e:  # XLA:TPU refuses to compile a program that cannot fit in HBM
        match = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", str(e))
        if not match:
            raise
        return head | {"fits": False, "compile_s": round(time.time() - t0, 1),
                       "per_chip_gib": {"temporaries": float(match.group(1))},  # XLA prints GiB as "G"
                       "error": str(e).splitlines()[0][:300]}, None
    compile_s = time.time() - t0
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    report = head | {
        "compile_s": round(compile_s, 1),
        "per_chip_gib": {"arguments": _gib(mem.argument_size_in_bytes), "outputs": _gib(mem.output_size_in_bytes),
                         "aliased": _gib(mem.alias_size_in_bytes), "temporaries": _gib(mem.temp_size_in_bytes),
                         "total": _gib(total)},
    }
    mf = model_flops(mcfg, ccfg, spec.batch, spec.seq, spec.exp_len, system.layout.length)
    report["model_flops"] = mf["total"]
    if args.flops:

        per = []
        splash = mcfg.attention_impl == "splash"
        batch_l = system.batch_shards(spec.batch) if splash else spec.batch
        for layers in (1, 2):
            cfg_l = mcfg.replace(num_layers=layers, layer_types=mcfg.layer_types[:layers], scan_layers=False,
                                 attention_impl="splash" if splash else "plain")
            s_cfg = (dataclasses.replace(spec.steps, micro_batch=0) if splash
                     else dataclasses.replace(spec.steps, loss=dataclasses.replace(spec.steps.loss, logits_chunk=spec.seq)))
            spec_l = dataclasses.replace(spec, model=cfg_l, steps=s_cfg, batch=batch_l)
            with unroll_scans():
                c, _ = build_step(spec_l, layout, devices)
            flops = float(c.cost_analysis()["flops"])
            if splash:
                flops += splash_kernel_flops(c.as_text(), mcfg.attention_block_q, mcfg.num_heads // mcfg.num_kv_heads)
            per.append(flops)
        compiled_flops = (per[0] + (mcfg.num_layers - 1) * (per[1] - per[0])) * len(devices) * spec.batch / batch_l
        report["compiled_flops"] = compiled_flops
        report["flops_ratio"] = compiled_flops / mf["total"]
    report["fits"] = hbm is None or report["per_chip_gib"]["total"] <= hbm
    return report, system


def run(args) -> dict:
    """Compile, measure and return the report dict (see :func:`parse_args` for ``args``)."""
    cfg = run_config(args)
    steps = selected_steps(cfg, args.steps)
    spec, layout = step_inputs(cfg)
    devices, gen, hbm = topology_devices(args.topology)
    mcfg, ccfg = spec.model, spec.composer
    head = {"config": args.config, "model": cfg.model.name or cfg.model.hf_path, "topology": args.topology,
            "chips": len(devices), "batch": spec.batch, "seq": spec.seq, "exp_len": spec.exp_len,
            "exp_uncut": cfg.composer.max_experience_tokens is None,
            "mesh": dict(zip(("data", "fsdp", "tensor"), spec.mesh.shape(len(devices)))),
            "rules": [list(r) for r in spec.mesh.rules if r not in DEFAULT_RULES], "remat": mcfg.remat_policy, "attention": mcfg.attention_impl,
            "dtype": mcfg.dtype, "param_dtype": mcfg.param_dtype, "logits_chunk": spec.steps.loss.logits_chunk,
            "micro_batch": spec.steps.micro_batch, "hbm_gib": hbm, "steps": steps}
    if args.dry_run:  # config, tokenizer and topology resolved; nothing lowered or compiled
        return head | {"dry_run": True, "latent_block_tokens": layout.length,
                       "model_flops": model_flops(mcfg, spec.composer, spec.batch, spec.seq, spec.exp_len,
                                                  layout.length)["total"]}
    if "lopd" in steps and not (args.estimate_only or args.largest_only):  # the padded LOPD step: the reference beside the passes
        report, system = _padded_lopd(args, head, spec, layout, devices, hbm)
        if system is None:
            return report
    else:
        report, system = head | {"fits": True}, build_system(spec, layout, devices)
    if args.estimate_only:
        report["estimate_only"] = True
    # every step's passes (lopd_jax.programs.compile_buckets): their shapes, and the step-time estimate
    report["length_steps"] = {}
    for kind in steps:
        rep = length_report(cfg, spec, system, gen, len(devices), step_flops_fn(kind, cfg, spec, system),
                            compile_passes=not args.estimate_only, kind=kind, largest_only=args.largest_only)
        report["length_steps"][kind] = rep
        if hbm is not None and "largest" in rep:
            report["fits"] = report["fits"] and rep["largest"]["per_chip_gib"]["total"] <= hbm
    return report


def write_report(report: dict, path: str | None) -> None:
    """Write ``report`` as JSON to ``path`` (``--json``; None: nowhere)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def verdict(report: dict, path: str | None) -> int:
    """Print whether ``report`` fits, write it (:func:`write_report`); exit status 0 fits, 1 not."""
    print("  fits" if report["fits"] else "  DOES NOT FIT")
    write_report(report, path)
    return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


def exit_codes_epilog() -> str:
    """The ``--help`` text listing :data:`EXIT_CODES`."""
    return "exit status:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items())


def parse_args(argv=None):
    """Command-line arguments of the compile check."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.compile_check", description=__doc__.split("\n\n")[0],
                                epilog=exit_codes_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)

    names = sorted(m.name for m in pkgutil.iter_modules(configs.__path__) if not m.name.startswith("_"))
    p.add_argument("--config", default="qwen3_8b",
                   help=f"a configs/NAME.py run config (default qwen3_8b): {', '.join(names)}")
    p.add_argument("--topology", default="v5p-32", help="v5p-32, v5e-64, v6e-8, ... or cpu:N")
    p.add_argument("--rule", action="append", default=[],
                   help="logical-axis rule remap on top of the config's, repeatable: --rule=act_embed=tensor")
    p.add_argument("--flops", action="store_true",
                   help="also count compiled FLOPs (two more compiles of unrolled 1- and 2-layer variants)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--steps", default=None,
                   help=f"comma-separated training steps to compile ({', '.join(STEP_KINDS)}); default: every "
                        "step the config runs (warm-up, cold start, the arm's). The padded LOPD step compiles "
                        "when lopd is one of them")
    p.add_argument("--dry_run", action="store_true",
                   help="resolve the config, tokenizer, mesh and topology, print them and stop before compiling")
    p.add_argument("--estimate_only", action="store_true",
                   help="compile nothing: print every step's padded / bucketed / packed estimate for the lengths "
                        "distribution (seconds of CPU; memory is not checked)")
    p.add_argument("--largest_only", action="store_true",
                   help="compile only each step's pass of the longest rows (its largest) and skip the padded LOPD "
                        "step: the memory check of the largest pass in a fraction of the time")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key=value, as for lopd_jax.train")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Entry point: print the table; exit 1 when the step does not fit."""

    args = parse_args(argv)
    report, code = exit_on_error(ERROR_EXITS, run, args)
    if code is not None:
        return code
    if report.get("dry_run"):
        mesh = report["mesh"]
        print(f"dry run  config={report['config']} ({report['model']})  topology={report['topology']} "
              f"({report['chips']} {'chips, HBM %s GiB' % report['hbm_gib'] if report['hbm_gib'] else 'devices'})  batch={report['batch']} x {report['seq']} "
              f"tokens, experiences {report['exp_len']}  latent block {report['latent_block_tokens']} tokens  "
              f"mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}  attention={report['attention']}  "
              f"model FLOPs/step {report['model_flops']:.3e}: resolved, not compiled")
        write_report(report, args.json)
        return 0
    if "error" in report:
        m = report["per_chip_gib"]
        print(f"LOPD step  config={report['config']}  topology={report['topology']} ({report['chips']} chips)  "
              f"batch={report['batch']} x {report['seq']} tokens: DOES NOT FIT -- XLA needs "
              f"{m['temporaries']:.1f} GiB of temporaries per chip (HBM {report['hbm_gib']} GiB)")
        write_report(report, args.json)
        return EXIT_DOES_NOT_FIT
    mesh = report["mesh"]
    padded = "per_chip_gib" in report
    print(f"{'padded LOPD step' if padded else 'steps'}  config={report['config']} ({report['model']})  "
          f"topology={report['topology']} ({report['chips']} chips)  batch={report['batch']} x {report['seq']} tokens, "
          f"experiences {report['exp_len']}{' (uncut: assumed)' if report['exp_uncut'] else ''}  mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}"
          + (f"  rules changed: {report['rules']}" if report["rules"] else ""))
    print(f"  attention={report['attention']}  micro_batch={report['micro_batch']}  remat={report['remat']}  "
          f"dtype={report['dtype']} (params {report['param_dtype']})  logits_chunk={report['logits_chunk']}"
          + (f"  compile {report['compile_s']} s" if padded else ""))
    if padded:
        print(memory_line(report["per_chip_gib"], report["hbm_gib"]))
        print(f"  model FLOPs/step {report['model_flops']:.3e}", end="")
        if "compiled_flops" in report:
            print(f"  compiled FLOPs/step {report['compiled_flops']:.3e}  ratio {report['flops_ratio']:.3f}")
        else:
            print()
    else:
        print("  padded LOPD step not compiled ("
              + ("--estimate_only" if report.get("estimate_only") else "--largest_only" if args.largest_only
                 else f"--steps={','.join(report['steps'])}") + ")")
    reps = list(report["length_steps"].values())
    print(distribution_line(reps[0]))
    for rep in reps:
        print("\n".join(length_lines(rep, report["hbm_gib"])))
    if report.get("estimate_only"):
        print("  estimate only: nothing compiled, memory not checked")
        write_report(report, args.json)
        return EXIT_FITS
    return verdict(report, args.json)

