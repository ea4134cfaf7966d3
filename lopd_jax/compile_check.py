"""Ahead-of-time compile of the real-size LOPD step for a TPU topology, on a CPU host.

    python -m lopd_jax.compile_check --model=qwen3_8b --topology=v5p-32 \
        --batch=32 --seq=40960 [--mesh.fsdp=-1 --remat=full --attention=blockwise ...]

Uses JAX's AOT path with ``libtpu`` installed and no chips (``jax.experimental.topologies``),
abstract shapes and no weights. Prints per-chip memory (arguments, outputs, temporaries,
total vs HBM), compiled FLOPs per step, analytic model FLOPs and their ratio; exits 1 when
the step does not fit in HBM. ``--topology=cpu:8`` does the same on simulated CPU devices.

``compiled.cost_analysis()`` counts a scan / while body once, so the FLOP count compiles
two extra *unrolled* variants (1 and 2 layers; layer, logits-chunk and micro-batch loops
unrolled) and extrapolates linearly in depth; remat recomputation is included, as it is in
the real step. With ``--attention=splash`` the variants keep the Pallas kernel, which XLA
does not cost: every splash custom call in the compiled HLO is counted by what it executes
(2 / 3 / 4 matmuls of block_q x block_kv x head_dim per active block and head for the
forward / dq / dkv kernels; causal block sparsity; blocks padded to the kernel block
size); these variants run one trajectory per batch shard (no micro-batching: unrolled
micro-steps would not fit) and are scaled to the batch (FLOPs per trajectory are the same;
the optimizer's ~1e-6 share is scaled too). Other attention impls count with plain
attention and one logits chunk at the full batch (which may not fit at long sequences). The compressor's shared-block loop stays a loop (its FLOPs
are counted for one of ``depth`` iterations; they are < 0.1% of the step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

HBM_GIB = {"v5e": 16.0, "v5p": 95.0, "v6e": 32.0, "v4": 32.0}
# chips per "name-N": v5p and v4 count TensorCores (2 per chip); v5e / v6e count chips.
CORES_PER_CHIP = {"v5p": 2, "v4": 2, "v5e": 1, "v6e": 1}
TOPOLOGY_SHAPES = {  # chips -> physical topology
    "v5p": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"},
    "v4": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
}


def topology_devices(topology: str):
    """Devices for ``v5p-32`` style TPU names (AOT, no chips) or ``cpu:N``; returns (devices, kind, hbm)."""
    import jax

    if topology.startswith("cpu:"):
        n = int(topology.split(":")[1])
        devs = jax.devices("cpu")
        if len(devs) < n:
            raise SystemExit(f"--topology={topology} needs {n} CPU devices; set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
        return devs[:n], "cpu", None
    try:
        gen, count = topology.split("-")
        chips = int(count) // CORES_PER_CHIP[gen]
        shape = TOPOLOGY_SHAPES[gen][chips]
    except (ValueError, KeyError):
        known = ", ".join(f"{g}-{c * CORES_PER_CHIP[g]}" for g in TOPOLOGY_SHAPES for c in TOPOLOGY_SHAPES[g])
        raise SystemExit(f"unknown topology {topology!r}; known: {known}, cpu:N")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chips: nothing to lock
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover
        raise SystemExit(f"jax.experimental.topologies unavailable: {e}")
    name = {"v5e": "v5e", "v6e": "v6e", "v5p": "v5p", "v4": "v4"}[gen]
    dims = [int(x) for x in shape.split("x")]
    bounds = (min(dims[0], 2), min(dims[1], 2), 1)  # hosts of up to 2x2 chips
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{name}:{shape}",
                                            chip_config_name="default", chips_per_host_bounds=bounds,
                                            num_slices=1)
    except Exception as e:
        raise SystemExit(f"could not build the {topology} topology ({e}). Install libtpu for this JAX: "
                         f"pip install -r requirements-tpu.txt")
    return list(desc.devices), gen, HBM_GIB[gen]


def model_flops(mcfg, ccfg, batch: int, seq: int, exp_len: int, l_ins: int) -> dict[str, float]:
    """Analytic FLOPs of one LOPD step (matmuls; causal attention counted at half).

    student fwd+bwd (weights and activations): 6 N T; teacher fwd + activation backward:
    4 N T_t; encoder fwd + activation/LoRA backward 4 N T_e (+ anchor forward 2 N T_e);
    LM heads over the supervised sequence for both models.
    """
    d, L, H, hd = mcfg.hidden_size, mcfg.num_layers, mcfg.num_heads, mcfg.head_dim
    n_layer = L * (d * hd * (2 * H + 2 * mcfg.num_kv_heads) + 3 * d * mcfg.intermediate_size)
    head = d * mcfg.vocab_size

    def attn(tokens_per_seq, n_seq):
        return 2 * 2 * n_seq * tokens_per_seq ** 2 * H * hd * L / 2  # QK^T and PV, causal

    t_s, t_t, t_e = batch * seq, batch * (seq + l_ins), batch * ccfg.n_ret * exp_len
    student = 6 * n_layer * t_s + 3 * attn(seq, batch) + 6 * head * t_s
    teacher = 4 * n_layer * t_t + 2 * attn(seq + l_ins, batch) + 4 * head * t_s
    encoder = 4 * n_layer * t_e + 2 * attn(exp_len, batch * ccfg.n_ret) + 2 * n_layer * t_e + attn(exp_len, batch * ccfg.n_ret)
    return {"student": student, "teacher": teacher, "encoder": encoder, "total": student + teacher + encoder}


def build_step(mcfg, ccfg, step_cfg, devices, mesh_cfg, batch, seq, exp_len):
    """(compiled, system) for the LOPD step lowered on ``devices`` with abstract inputs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lopd_jax.composer import make_compressor
    from lopd_jax.splice import SpliceLayout
    from models.decoder import Decoder
    from train import mesh as mesh_lib
    from train.steps import make_lopd_step
    from train.system import LOPDSystem

    mesh = mesh_lib.make_mesh(mesh_cfg, devices)
    rules = mesh_lib.rules_for(mesh, mesh_cfg)
    backbone = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0), rules=rules))
    compressor = nnx.eval_shape(lambda: make_compressor(mcfg, ccfg, nnx.Rngs(0)))
    layout = SpliceLayout(before_ids=tuple(range(1, 17)), after_ids=tuple(range(17, 33)),
                          num_slots=ccfg.num_slots, slot_id=0)
    system = LOPDSystem(backbone, compressor, ccfg, layout, step_cfg, rules)
    state, frozen = system.abstract_state()
    b = {
        "tokens": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        "attention_mask": jax.ShapeDtypeStruct((batch, seq), jnp.bool_),
        "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32),
        "insert_at": jax.ShapeDtypeStruct((batch,), jnp.int32),
        "exp_tokens": jax.ShapeDtypeStruct((batch, ccfg.n_ret, exp_len), jnp.int32),
        "exp_mask": jax.ShapeDtypeStruct((batch, ccfg.n_ret, exp_len), jnp.bool_),
        "rewards": jax.ShapeDtypeStruct((batch,), jnp.float32),
    }
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
    computed, each costing 2 * b^2 * hd per matmul and head.
    """
    from models.splash import _block

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


def rules_with(overrides) -> tuple:
    """The default logical-axis rules with ``name=axis[+axis]`` overrides (``none`` = replicated)."""
    from models.partitioning import DEFAULT_RULES

    table = dict(DEFAULT_RULES)
    for item in overrides or ():
        name, _, axes = item.partition("=")
        if name not in table or not axes:
            raise ValueError(f"--rule {item!r}: use LOGICAL=AXIS with LOGICAL one of {sorted(table)}")
        parts = tuple(a for a in axes.split("+") if a)
        table[name] = None if axes == "none" else (parts[0] if len(parts) == 1 else parts)
    return tuple(table.items())


def _gib(x):
    return x / 2**30


def run(args) -> dict:
    """Compile, measure and return the report dict."""
    import jax

    from lopd_jax.composer import ComposerConfig
    from models.config import named_config
    from train.mesh import MeshConfig
    from train.system import StepConfig

    devices, gen, hbm = topology_devices(args.topology)
    mcfg = named_config(args.model, dtype=args.dtype, param_dtype=args.param_dtype, remat_policy=args.remat,
                        attention_impl=args.attention, attention_block_q=args.block, attention_block_kv=args.block)
    ccfg = ComposerConfig(num_latents=args.latents, n_ret=args.n_ret, depth=args.depth)
    mcfg = mcfg.replace(lora=ccfg.lora)
    if args.layers:
        mcfg = mcfg.replace(num_layers=args.layers, layer_types=mcfg.layer_types[:args.layers])
    step_cfg = StepConfig(logits_chunk=args.logits_chunk, top_m=args.top_m, micro_batch=args.micro_batch)
    mesh_cfg = MeshConfig(data=args.data, fsdp=args.fsdp, tensor=args.tensor, rules=rules_with(args.rule))
    t0 = time.time()
    try:
        compiled, system = build_step(mcfg, ccfg, step_cfg, devices, mesh_cfg, args.batch, args.seq, args.exp_len)
    except Exception as e:  # XLA:TPU refuses to compile a program that cannot fit in HBM
        match = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", str(e))
        if not match:
            raise
        return {"model": args.model, "topology": args.topology, "chips": len(devices), "batch": args.batch,
                "seq": args.seq, "remat": args.remat, "attention": args.attention, "fits": False,
                "compile_s": round(time.time() - t0, 1), "hbm_gib": hbm,
                "per_chip_gib": {"temporaries": float(match.group(1))},  # XLA prints GiB as "G"
                "error": str(e).splitlines()[0][:300]}
    compile_s = time.time() - t0
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    report = {
        "model": args.model, "topology": args.topology, "chips": len(devices), "batch": args.batch,
        "seq": args.seq, "exp_len": args.exp_len, "mesh": dataclasses.asdict(mesh_cfg) | {"rules": args.rule},
        "remat": args.remat, "attention": args.attention, "logits_chunk": args.logits_chunk,
        "micro_batch": args.micro_batch,
        "compile_s": round(compile_s, 1),
        "per_chip_gib": {"arguments": _gib(mem.argument_size_in_bytes), "outputs": _gib(mem.output_size_in_bytes),
                         "aliased": _gib(mem.alias_size_in_bytes), "temporaries": _gib(mem.temp_size_in_bytes),
                         "total": _gib(total)},
        "hbm_gib": hbm,
    }
    mf = model_flops(mcfg, ccfg, args.batch, args.seq, args.exp_len, system.layout.length)
    report["model_flops"] = mf["total"]
    if not args.skip_flops:
        from lopd_jax.losses_kl import unroll_scans

        per = []
        splash = args.attention == "splash"
        batch_l = system.batch_shards(args.batch) if splash else args.batch
        for layers in (1, 2):
            cfg_l = mcfg.replace(num_layers=layers, layer_types=mcfg.layer_types[:layers], scan_layers=False,
                                 attention_impl="splash" if splash else "plain")
            s_cfg = (dataclasses.replace(step_cfg, micro_batch=0) if splash
                     else dataclasses.replace(step_cfg, logits_chunk=args.seq))
            with unroll_scans():
                c, _ = build_step(cfg_l, ccfg, s_cfg, devices, mesh_cfg, batch_l, args.seq, args.exp_len)
            flops = float(c.cost_analysis()["flops"])
            if splash:
                flops += splash_kernel_flops(c.as_text(), args.block, mcfg.num_heads // mcfg.num_kv_heads)
            per.append(flops)
        compiled_flops = (per[0] + (mcfg.num_layers - 1) * (per[1] - per[0])) * len(devices) * args.batch / batch_l
        report["compiled_flops"] = compiled_flops
        report["flops_ratio"] = compiled_flops / mf["total"]
    report["fits"] = hbm is None or report["per_chip_gib"]["total"] <= hbm
    return report


def parse_args(argv=None):
    """Command-line arguments of the compile check."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--config", dest="model", default="qwen3_8b",
                   help="named model config (models.config.named_config)")
    p.add_argument("--topology", default="v5p-32", help="v5p-32, v5e-64, v6e-8, ... or cpu:N")
    p.add_argument("--batch", type=int, default=32, help="trajectories per step")
    p.add_argument("--seq", type=int, default=40960, help="tokens per trajectory")
    p.add_argument("--exp_len", type=int, default=2048, help="tokens per retrieved experience")
    p.add_argument("--latents", type=int, default=32)
    p.add_argument("--n_ret", type=int, default=3)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--layers", type=int, default=0, help="override the number of layers (0 = as configured)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--param_dtype", default="float32")
    p.add_argument("--remat", default="full")
    p.add_argument("--attention", default="blockwise")
    p.add_argument("--block", type=int, default=512, help="attention block size")
    p.add_argument("--logits_chunk", type=int, default=1024)
    p.add_argument("--top_m", type=int, default=20)
    p.add_argument("--micro_batch", type=int, default=0,
                   help="trajectories per batch shard per forward/backward pass (0 = all at once)")
    p.add_argument("--data", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=-1)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--rule", action="append", default=[],
                   help="logical-axis rule override, repeatable: e.g. --rule=act_embed=tensor")
    p.add_argument("--skip_flops", action="store_true", help="skip the unrolled FLOP-count compiles")
    p.add_argument("--json", default=None, help="also write the report here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Entry point: print the table; exit 1 when the step does not fit."""
    args = parse_args(argv)
    try:
        report = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = report["per_chip_gib"]
    if "error" in report:
        print(f"LOPD step  model={report['model']}  topology={report['topology']} ({report['chips']} chips)  "
              f"batch={report['batch']} x {report['seq']} tokens: DOES NOT FIT -- XLA needs "
              f"{m['temporaries']:.1f} GiB of temporaries per chip (HBM {report['hbm_gib']} GiB)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return 1
    print(f"LOPD step  model={report['model']}  topology={report['topology']} ({report['chips']} chips)  "
          f"batch={report['batch']} x {report['seq']} tokens  remat={report['remat']}  "
          f"attention={report['attention']}  compile {report['compile_s']} s")
    print(f"  per chip GiB: arguments {m['arguments']:.2f}  outputs {m['outputs']:.2f}  aliased {m['aliased']:.2f}  "
          f"temporaries {m['temporaries']:.2f}  total {m['total']:.2f}"
          + (f"  / HBM {report['hbm_gib']:.0f}" if report["hbm_gib"] else ""))
    print(f"  model FLOPs/step {report['model_flops']:.3e}", end="")
    if "compiled_flops" in report:
        print(f"  compiled FLOPs/step {report['compiled_flops']:.3e}  ratio {report['flops_ratio']:.3f}")
    else:
        print()
    print("  fits" if report["fits"] else "  DOES NOT FIT")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
