"""Ahead-of-time compile of the rollout sampler for a TPU topology, on a CPU host.

    python -m lopd_jax.compile_sampler --model=qwen3_8b --topology=v5p-32 \
        --batch=32 --cache=40960 --chunk=2048 [--new_tokens=2048 --fsdp=-1 ...]

Lowers, with abstract shapes and no weights (like :mod:`lopd_jax.compile_check` for the
train step), the two programs a rollout turn runs on the run's mesh:

* **turn**: :class:`train.sampler.Sampler`'s compiled turn -- prefill of a ``chunk``-token
  chunk per row into a KV cache of ``cache`` slots, then the decode ``while_loop`` of up
  to ``new_tokens`` tokens (the program that runs; its memory is the sampler's per-chip
  memory);
* **decode step**: one decode step of all ``batch`` rows against a full cache (the
  decoder's cached call, the LM head and sampling), whose compiled cost analysis gives the
  bytes one step moves per chip.

Prints per-chip memory (arguments = weights + cache, temporaries, total vs HBM) and a
roofline decode rate: ``batch / (bytes accessed per chip per step / HBM bandwidth)``
tokens per second for the whole batch (2.76 TB/s per v5p chip); decode is memory bound
(every step reads the weights and the whole cache), so this is an upper bound. Exits 1
when the turn does not fit in HBM.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HBM_BANDWIDTH = {"v5p": 2.76e12, "v5e": 0.819e12, "v6e": 1.64e12, "v4": 1.2e12}  # bytes/s per chip


def build(args):
    """``(turn, step, info)``: the compiled turn and decode step and the layout used."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lopd_jax.compile_check import rules_with, topology_devices
    from models.config import named_config
    from models.decoder import Decoder, KVCache
    from train import mesh as mesh_lib
    from train.mesh import MeshConfig
    from train.sampler import Sampler
    from train.sampling import sample_logits

    devices, gen, hbm = topology_devices(args.topology)
    mcfg = named_config(args.model, dtype=args.dtype, param_dtype=args.param_dtype)
    if args.layers:
        mcfg = mcfg.replace(num_layers=args.layers, layer_types=mcfg.layer_types[:args.layers])
    mesh_cfg = MeshConfig(data=args.data, fsdp=args.fsdp, tensor=args.tensor, rules=rules_with(MeshConfig().rules, args.rule))
    mesh = mesh_lib.make_mesh(mesh_cfg, devices)
    rules = mesh_lib.rules_for(mesh, mesh_cfg)
    model = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0), rules=rules))
    gd, (abstract,), (axes,) = mesh_lib.split_state(model)
    shardings = mesh_lib.tree_shardings(abstract, axes, rules)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    sampler = Sampler(model, stop_ids=(1,), rules=rules, decode_layers="scan", prefill_block=args.prefill_block)
    B = sampler.batch_bucket(args.batch)
    spec = sampler._cache_spec.k
    shape = (spec.shape[0], B, args.cache, *spec.shape[3:])
    kv_sh = sampler._kv_sharding(sampler._cache_spec, shape)
    kv = KVCache(jax.ShapeDtypeStruct(shape, spec.dtype, sharding=kv_sh.k),
                 jax.ShapeDtypeStruct(shape, spec.dtype, sharding=kv_sh.v),
                 jax.ShapeDtypeStruct((B,), jnp.int32, sharding=kv_sh.lengths))
    b1, b2 = sampler._batch_sharding(1), sampler._batch_sharding(2)
    rep = rules.replicated()
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    f32 = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)

    t0 = time.time()
    turn_fn = sampler._fn(args.new_tokens, args.top_k, False, (B, args.chunk, args.cache), False, kv)
    turn = turn_fn.lower(params, kv, jax.ShapeDtypeStruct((B, args.chunk), jnp.int32, sharding=b2),
                         jax.ShapeDtypeStruct((B,), jnp.int32, sharding=b1),
                         jax.ShapeDtypeStruct((B,), jnp.int32, sharding=b1), key, f32, f32, None).compile()
    turn_s = time.time() - t0

    def one_step(params, kv, prev, live, key, temperature, top_p):
        m = nnx.merge(gd, params)
        h, kv = m(prev[:, None], positions=kv.lengths[:, None], attention_mask=live[:, None], cache=kv,
                  return_hidden=True)
        logits = jnp.dot(h[:, 0].astype(jnp.float32), m.lm_head_kernel().astype(jnp.float32))
        tok, lp, raw = sample_logits(logits, key, temperature, top_p, args.top_k)
        return tok, lp, raw, kv

    t0 = time.time()
    step = jax.jit(one_step, donate_argnums=(1,), out_shardings=(b1, b1, b1, kv_sh)).lower(
        params, kv, jax.ShapeDtypeStruct((B,), jnp.int32, sharding=b1),
        jax.ShapeDtypeStruct((B,), jnp.bool_, sharding=b1), key, f32, f32).compile()
    step_s = time.time() - t0
    info = {"model": args.model, "topology": args.topology, "chips": len(devices), "gen": gen, "hbm_gib": hbm,
            "batch": B, "cache": args.cache, "chunk": args.chunk, "new_tokens": args.new_tokens,
            "mesh": dataclasses.asdict(mesh_cfg) | {"rules": args.rule}, "compile_s": {"turn": round(turn_s, 1),
                                                                                       "decode_step": round(step_s, 1)}}
    return turn, step, info


def _gib(x):
    return x / 2**30


def run(args) -> dict:
    """Compile both programs and return the report dict."""
    turn, step, report = build(args)
    mem = turn.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    report["per_chip_gib"] = {"arguments": _gib(mem.argument_size_in_bytes), "outputs": _gib(mem.output_size_in_bytes),
                              "aliased": _gib(mem.alias_size_in_bytes), "temporaries": _gib(mem.temp_size_in_bytes),
                              "total": _gib(total)}
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    step_bytes = float(cost.get("bytes accessed", 0.0))
    report["decode_step"] = {"bytes_accessed_per_chip": step_bytes, "flops_per_chip": float(cost.get("flops", 0.0))}
    bw = HBM_BANDWIDTH.get(report["gen"])
    if bw and step_bytes:
        step_s = step_bytes / bw
        report["decode_step"].update({"roofline_step_ms": 1e3 * step_s,
                                      "roofline_tokens_per_s": report["batch"] / step_s,
                                      "hbm_bytes_per_s": bw})
    report["fits"] = report["hbm_gib"] is None or report["per_chip_gib"]["total"] <= report["hbm_gib"]
    return report


def parse_args(argv=None):
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3_8b", help="named model config (models.config.named_config)")
    p.add_argument("--topology", default="v5p-32", help="v5p-32, v5e-64, ... or cpu:N")
    p.add_argument("--batch", type=int, default=32, help="rollouts decoded together")
    p.add_argument("--cache", type=int, default=40960, help="KV cache slots per row")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk per row (a prompt / observation)")
    p.add_argument("--new_tokens", type=int, default=2048, help="decode buffer per turn")
    p.add_argument("--prefill_block", type=int, default=256)
    p.add_argument("--top_k", type=int, default=20)
    p.add_argument("--layers", type=int, default=0, help="override the number of layers (0 = as configured)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--param_dtype", default="float32")
    p.add_argument("--data", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=-1)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--rule", action="append", default=[], help="logical-axis rule override (repeatable)")
    p.add_argument("--json", default=None, help="also write the report here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Entry point: print the report; exit 1 when the turn does not fit."""
    from lopd_jax.startup import configure_platform

    args = parse_args(argv)
    if not args.topology.startswith("cpu:"):
        os.environ.setdefault("JAX_PLATFORMS", "")  # the TPU plugin compiles for the topology
    configure_platform()
    from lopd_jax.compile_buckets import memory_line
    from lopd_jax.compile_check import verdict

    r = run(args)
    m, d = r["per_chip_gib"], r["decode_step"]
    print(f"sampler  model={r['model']}  topology={r['topology']} ({r['chips']} chips)  batch={r['batch']}  "
          f"cache={r['cache']}  chunk={r['chunk']}  new_tokens={r['new_tokens']}  compile {r['compile_s']}")
    print(memory_line(m, r["hbm_gib"], "turn per chip GiB"))
    print(f"  decode step per chip: {d['bytes_accessed_per_chip'] / 2**30:.2f} GiB accessed, "
          f"{d['flops_per_chip']:.3e} FLOPs", end="")
    if "roofline_tokens_per_s" in d:
        print(f"  -> roofline {d['roofline_step_ms']:.2f} ms/step, {d['roofline_tokens_per_s']:.0f} tokens/s "
              f"for the batch at {d['hbm_bytes_per_s'] / 1e12:.2f} TB/s per chip")
    else:
        print()
    return verdict(r, args.json)


if __name__ == "__main__":
    sys.exit(main())
