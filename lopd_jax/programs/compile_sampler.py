"""Ahead-of-time compile of the rollout engine's decode step for a TPU topology, on a CPU host.

    python -m lopd_jax.compile_sampler --config=qwen3_8b --topology=v5p-32 [key=value ...]

From the run config the trainer uses, it sizes the engine for the slice (slots, episodes
in flight and a page pool from a schedule simulation of the config's length distribution,
:mod:`lopd_jax.planning.engine_schedule`), compiles one process's decode call and the once-per-step
reshard from the trainer's FSDP parameters exactly as :class:`lopd_jax.rollout.engine.Engine`
builds them, and prints per-chip memory, HBM bytes per decode step and roofline time per
useful token against the static sampler and the read-weights-once bound. Exits 1 when
the engine does not fit in HBM. The sizing rule and the roofline accounting:
docs/engine.md, "AOT at slice size".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lopd_jax.programs.compile_buckets import HBM_BANDWIDTH, ICI_BANDWIDTH, memory_line
from lopd_jax.programs.compile_check import ERROR_EXITS, EXIT_BAD_ARGS, run_config, topology_devices, verdict
from lopd_jax.programs.launcher import exit_on_error
from lopd_jax.programs.compile_rl_step import (HOST_CHUNK_MS, HOST_STEP_S, print_report as print_rl_report,
                                               report as rl_report)
from models.decoder import Decoder
from train import mesh as mesh_lib
from models.partitioning import split_state, tree_shardings
from lopd_jax.rollout import engine_calls
from lopd_jax.rollout.engine import Engine
from lopd_jax.planning.engine_schedule import draw_episodes, pool_pages, simulate_engine, simulate_static
from lopd_jax.rollout.layout import (attention_mesh, global_merge, inference_shardings, pool_sharding,
                                    reshard_cost)
from lopd_jax.rollout.paged_step import paged_forward_scan
from lopd_jax.rollout.sampling import sample_logits

KERNEL_PAGES_PER_BLOCK = 8  # models.paged_attention.kernel_blocks' default


def _gib(x) -> float:
    return x / 2**30


def sizing(cfg, processes: int, episodes_per_slot: int, env_steps: int, pool: str = "auto") -> dict:
    """Slots, episodes in flight and the page pool for the slice, from the config and a
    schedule simulation of the engine and of the static sampler (:mod:`lopd_jax.planning.engine_schedule`).
    ``pool``: ``rule``, ``config`` (``engine.num_pages`` x processes) or ``auto`` (the larger)."""
    e, r = cfg.engine, cfg.rollout.caps
    slots = e.slots * processes
    in_flight = getattr(e, "max_in_flight", 0) * processes or 2 * slots
    eps = draw_episodes(cfg.lengths, episodes_per_slot * slots, r.max_env_steps, r.max_turn_tokens,
                        r.max_total_tokens, seed=cfg.seed)
    sim = simulate_engine(eps, slots, in_flight, e.decode_chunk, env_steps)
    static = simulate_static(eps, slots, env_steps)
    rule = pool_pages(sim["live_tokens_p99"], in_flight, e.page_size, r.max_total_tokens)
    configured = e.num_pages * processes
    if pool == "config" and not configured:
        raise ValueError("--pool=config needs engine.num_pages > 0 in the config (or as an override)")
    pages = {"rule": rule, "config": configured}.get(pool, max(configured, rule))
    return {"processes": processes, "slots": slots, "in_flight": in_flight, "episodes": len(eps), "page_size": e.page_size,
            "decode_chunk": e.decode_chunk, "pages_rule": rule, "pages_configured": configured, "pages": pages,
            "pages_from": "engine.num_pages" if pages == configured else "rule", "engine_sim": sim,
            "static_sim": static,
            "max_total_tokens": r.max_total_tokens}


def estimate_gib(mcfg, pages: int, page_size: int, tensor: int, chips: int, hbm: float = 95.0,
                 kv_bytes: int = 2) -> dict:
    """Per-chip GiB one process's engine holds before any temporaries: its page pool of
    ``pages`` (KV heads split over ``tensor``, whole on every ``data`` replica), its weight
    shard (``1 / tensor`` of the bf16 weights) and the trainer's fp32 params (FSDP over all
    ``chips``); ``max_pages``: the largest pool per process that leaves 10% of ``hbm`` GiB
    per chip for temporaries. ``kv_bytes``: bytes per pool element (the engine's dtype)."""
    kv_page = page_size * 2 * mcfg.num_kv_heads * mcfg.head_dim * kv_bytes * mcfg.num_layers  # bytes, every layer
    n = mcfg.num_params()
    est = {"pool": pages * kv_page / tensor / 2**30, "weights": kv_bytes * n / tensor / 2**30,
           "trainer": 4 * n / chips / 2**30}
    est["total"] = sum(est.values())
    free = 0.9 * hbm - est["weights"] - est["trainer"]
    est["max_pages"] = max(0, int(free * 2**30 * tensor // kv_page))
    return est


class DoesNotFit(Exception):
    """The engine cannot fit in HBM (found before or while compiling)."""


def build(args, cfg, devices, size: dict, hbm: float | None = None):
    """Compile one process's engine decode call and the reshard; returns ``(step, reshard,
    info)``. Raises :class:`DoesNotFit` when the pool and weights alone exceed ``hbm`` GiB
    per chip, or XLA runs out of HBM compiling.

    The engine is the one :class:`lopd_jax.rollout.engine.Engine` builds from the config's ``engine``
    section on the first process's devices (its mesh, weight and pool layouts, dtype); the
    step is its decode call (:func:`lopd_jax.rollout.engine_calls.decode`, ``decode_chunk`` steps) and
    the reshard the collective its :meth:`~lopd_jax.rollout.engine.Engine.local_params` runs on FSDP
    params spanning processes (:func:`lopd_jax.rollout.layout.global_merge`)."""
    mcfg, ecfg, host, engine = _abstract_engine(args, cfg, devices)
    mesh, tensor, dtype = engine.mesh, engine.mesh.shape["tensor"], jnp.dtype(ecfg.dtype)
    data, processes, slots = mesh.shape["data"], size["processes"], ecfg.slots
    pages = -(-size["pages"] // processes)
    width = 1 << max(0, math.ceil(math.log2(-(-size["max_total_tokens"] // size["page_size"]))))
    _check_estimate(mcfg, ecfg, size, pages, tensor, len(devices), hbm)
    reshard_c, grid, reshard_s = _compile_reshard(cfg, mcfg, ecfg, engine, devices, tensor)
    params, rows, key, sampling = _decode_inputs(cfg, mcfg, ecfg, engine, width)
    pool_shape = (pages, size["page_size"], 2 * mcfg.num_kv_heads, mcfg.head_dim)
    t0 = time.time()
    if args.layers_impl == "scan":
        lowered = _lower_scan_step(args, mcfg, engine, pool_shape, dtype, width, params, rows, key, sampling)
    else:
        lowered = _lower_engine_decode(args, mcfg, engine, pool_shape, dtype, params, rows, key, sampling)
    step_c = _compile_or_does_not_fit(lowered)
    step_s = time.time() - t0
    kernels = step_c.as_text().count('custom_call_target="tpu_custom_call"')
    info = {"layers_impl": args.layers_impl, "tensor": tensor, "data": data, "engine_devices": len(host),
            "slots_compiled": slots, "pages_compiled": pages, "table_width": width,
            "decode_steps_per_call": 1 if args.layers_impl == "scan" else ecfg.decode_chunk, "dtype": ecfg.dtype,
            "reshard_layout": "tensor shards" if grid is not None else "replicated",
            "train_mesh": dict(zip(("data", "fsdp", "tensor"), cfg.mesh.shape(len(devices)))),
            "compile_s": {"decode_step": round(step_s, 1), "reshard": round(reshard_s, 1)},
            "attention_kernels": kernels, "model_params": mcfg.num_params(), "num_layers": mcfg.num_layers,
            "kv_bytes_per_token": 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize,
            "mcfg": mcfg}
    return step_c, reshard_c, info


def _abstract(tree, shardings):
    """``tree``'s arrays as :class:`jax.ShapeDtypeStruct` placed by ``shardings`` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _replicated(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract array of ``shape`` and ``dtype`` replicated over ``mesh``."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def _abstract_engine(args, cfg, devices):
    """``(mcfg, ecfg, host, engine)``: the model config (``--layers`` applied), the ``engine``
    section (``--tensor`` applied), the first process's devices and the
    :class:`~lopd_jax.rollout.engine.Engine` those build on them from an abstract model."""
    mcfg = cfg.model_config()
    if args.layers:
        mcfg = mcfg.replace(num_layers=args.layers, layer_types=mcfg.layer_types[:args.layers])
    ecfg = dataclasses.replace(cfg.engine, tensor=args.tensor) if args.tensor else cfg.engine
    host = [d for d in devices if d.process_index == devices[0].process_index]
    abstract_model = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0)))
    engine = Engine(abstract_model, stop_ids=(0,), config=ecfg, lora=mcfg.lora is not None, devices=host)
    return mcfg, ecfg, host, engine


def _check_estimate(mcfg, ecfg, size: dict, pages: int, tensor: int, chips: int, hbm: float | None) -> None:
    """Raise :class:`DoesNotFit` when :func:`estimate_gib`'s pool and weights of ``pages`` per
    process alone exceed ``hbm`` GiB per chip (no compile needed to know)."""
    est = estimate_gib(mcfg, pages, size["page_size"], tensor, chips, hbm or 95.0, jnp.dtype(ecfg.dtype).itemsize)
    if hbm is not None and est["total"] > hbm:
        raise DoesNotFit(f"the engine's pool and weights alone need {est['total']:.1f} GiB per chip of {hbm:.0f} "
                         f"(pool {est['pool']:.1f}, {ecfg.dtype} weights {est['weights']:.1f}, trainer's fp32 params "
                         f"{est['trainer']:.1f}); fewer slots or a smaller pool: about {est['max_pages']:,} pages "
                         f"of {size['page_size']} per process fit (engine.num_pages)")


def _compile_reshard(cfg, mcfg, ecfg, engine, devices, tensor: int):
    """Compile the reshard of the trainer's params (fp32, FSDP over the slice, LoRA) to each
    process's engine; ``(compiled, grid, seconds)``, ``grid`` None when its output is replicated."""
    train_mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    rules = mesh_lib.rules_for(train_mesh, cfg.mesh)
    _, (tabs,), (taxes,) = split_state(nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0), rules=rules)))
    train_sh = tree_shardings(tabs, taxes, rules)
    reshard, grid = global_merge(engine.train_cfg, train_mesh.devices.flat, tensor, engine.shardings, ecfg.dtype)
    t0 = time.time()
    compiled = _compile_or_does_not_fit(reshard.lower(_abstract(tabs, train_sh)))
    return compiled, grid, time.time() - t0


def _decode_inputs(cfg, mcfg, ecfg, engine, width: int):
    """The decode step's abstract inputs other than the pools, ``(params, rows, key,
    sampling)``: the engine's weights in its layout, a
    :class:`~lopd_jax.rollout.engine_rows.DecodeRows` of ``ecfg.slots`` rows with a page table
    ``width`` pages wide, the call's key and the sampling parameters."""
    mesh, slots = engine.mesh, ecfg.slots
    params = _abstract(inference_shardings(mcfg, mesh, ecfg.dtype)[1], engine.shardings)
    prev, lengths, live, remaining = (_replicated(mesh, (slots,), t) for t in (jnp.int32, jnp.int32, jnp.bool_,
                                                                               jnp.int32))
    rows = engine_calls.DecodeRows(prev, lengths, live, remaining, _replicated(mesh, (slots, width), jnp.int32),
                                   _replicated(mesh, (slots,), jnp.int32))
    key, scalar = _replicated(mesh, (), jax.random.key(0).dtype), _replicated(mesh, (), jnp.float32)
    sampling = jax.tree.map(lambda _: scalar, cfg.rollout.sampling)  # traced leaves, static top_k / greedy
    return params, rows, key, sampling


def _lower_scan_step(args, mcfg, engine, pool_shape, dtype, width: int, params, rows, key, sampling):
    """``--layers_impl=scan``: one decode step scanning the layers over one stacked pool
    [L, P, ...] (not the engine's call), lowered on the abstract inputs."""
    mesh = engine.mesh
    pools = jax.ShapeDtypeStruct((mcfg.num_layers, *pool_shape), dtype,
                                 sharding=NamedSharding(mesh, P(None, None, None, "tensor", None)))

    def step(params, pools, prev, lengths, live, table, keys, sp):
        model = nnx.merge(engine.graphdef, params)
        h, pools = paged_forward_scan(model, prev[:, None], lengths[:, None], live[:, None], lengths + live,
                                      pools, table, width, backend=args.backend, mesh=attention_mesh(mesh))
        logits = jnp.dot(h[:, 0].astype(jnp.float32), model.lm_head_kernel().astype(jnp.float32))
        one = lambda l, k: tuple(x[0] for x in sample_logits(  # noqa: E731
            l[None], k, sp.temperature, sp.top_p, sp.top_k))
        return (*jax.vmap(one)(logits, keys), pools)
    keys = _replicated(mesh, rows.prev.shape, key.dtype)  # a key per row
    return jax.jit(step, donate_argnums=(1,)).lower(params, pools, rows.prev, rows.lengths, rows.live,
                                                    rows.page_table, keys, sampling)


def _lower_engine_decode(args, mcfg, engine, pool_shape, dtype, params, rows, key, sampling):
    """The engine's decode call (per-layer pools), as :meth:`~lopd_jax.rollout.engine.Engine.run`
    makes it, lowered on the abstract inputs; ``--backend`` must be ``auto``."""
    if args.backend != "auto":
        raise ValueError("--backend applies to --layers_impl=scan; the engine's call picks its backend itself")
    pools = (jax.ShapeDtypeStruct(pool_shape, dtype, sharding=pool_sharding(engine.mesh)),) * mcfg.num_layers
    return engine_calls.decode.lower(engine.program, params, pools, rows, sampling, key)


def _compile_or_does_not_fit(lowered):
    """``lowered.compile()``; XLA's out-of-HBM refusal becomes :class:`DoesNotFit`."""
    try:
        return lowered.compile()
    except Exception as e:  # JaxRuntimeError; only its out-of-memory kind is a verdict
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFit(f"XLA: {str(e).splitlines()[0]}") from e


def _mem(compiled) -> dict:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"arguments": _gib(m.argument_size_in_bytes), "outputs": _gib(m.output_size_in_bytes),
            "aliased": _gib(m.alias_size_in_bytes), "temporaries": _gib(m.temp_size_in_bytes), "total": _gib(total)}


def _bytes_accessed(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("bytes accessed", 0.0))


def roofline(size: dict, info: dict, chips: int, bw: float) -> dict:
    """Per-chip bytes per decode step and microseconds per useful token (module docstring)."""
    sim, static = size["engine_sim"], size["static_sim"]
    slots, ps, kvt = size["slots"], size["page_size"], info["kv_bytes_per_token"]
    weights_shard = 2 * info["model_params"] / info["tensor"]
    running = sim["running_tokens_mean"]  # live context of the decoding rows, summed
    block = KERNEL_PAGES_PER_BLOCK * ps
    read = running + slots * sim["utilisation"] * block / 2  # each running row rounds up half a block
    # a process's rows' pages over its tensor chips (each data replica reads them all)
    engine_step = weights_shard + read / size["processes"] * kvt / info["tensor"]
    bound_step = weights_shard + running * kvt / chips
    dense_t = 1 << math.ceil(math.log2(size["max_total_tokens"]))
    static_step = 2 * info["model_params"] + slots * dense_t * kvt / chips
    us = lambda b, tokens: 1e6 * b / bw / tokens
    return {"engine_step_bytes": engine_step, "bound_step_bytes": bound_step, "static_step_bytes": static_step,
            "engine_us_per_token": us(engine_step, slots * sim["utilisation"]),
            "bound_us_per_token": us(bound_step, slots),
            "static_us_per_token": us(static_step, slots * static["utilisation"]),
            "hbm_bytes_per_s": bw}


def run(args) -> dict:
    """Size, compile and return the report dict."""

    cfg = run_config(args)
    devices, gen, hbm = topology_devices(args.topology)
    processes = len({d.process_index for d in devices}) if not args.processes else args.processes
    size = sizing(cfg, processes, args.episodes_per_slot, args.env_steps, args.pool)
    head = {"config": args.config, "topology": args.topology, "chips": len(devices), "processes": processes,
            "gen": gen, "hbm_gib": hbm, "sizing": size}
    try:
        step, reshard, info = build(args, cfg, devices, size, hbm)
    except DoesNotFit as e:
        return head | {"fits": False, "reason": str(e)}
    mcfg = info.pop("mcfg")
    mem = _mem(step)
    resident = _mem(reshard)["arguments"]  # the trainer's params stay in HBM while the engine runs
    report = {**head, **info, "per_chip_gib": mem | {"trainer_params": resident},
              "decode_step": {"xla_bytes_accessed_per_chip": _bytes_accessed(step)},
              "reshard": {"xla_bytes_accessed_per_chip": _bytes_accessed(reshard), "memory_gib": _mem(reshard)}}
    report["per_chip_gib"]["engine_total"] = mem["total"] + resident
    bw, ici = HBM_BANDWIDTH.get(gen), ICI_BANDWIDTH.get(gen)
    if bw:
        report["decode_step"].update(roofline(size, info, len(devices), bw))
        c = reshard_cost(mcfg, len(devices), info["tensor"], bw, ici)
        report["reshard"].update(dataclasses.asdict(c))
    report["fits"] = hbm is None or report["per_chip_gib"]["engine_total"] <= hbm
    return report


def parse_args(argv=None):
    """Command-line arguments."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.compile_sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3_8b", help="a configs/NAME.py run config")
    p.add_argument("--topology", default="v5p-32", help="v5p-32, v5e-64, ... or cpu:N")
    p.add_argument("--tensor", type=int, default=0,
                   help="the engine's tensor-parallel width over a host's chips (0: engine.tensor from the config)")
    p.add_argument("--backend", default="auto",
                   help="paged attention backend of --layers_impl=scan: auto (kernel on TPU), kernel, xla")
    p.add_argument("--pool", choices=("auto", "rule", "config"), default="auto",
                   help="page pool: the sizing rule's, the config's (engine.num_pages x processes), or the larger")
    p.add_argument("--processes", type=int, default=0, help="processes of the slice (0: the topology's hosts)")
    p.add_argument("--episodes_per_slot", type=int, default=32, help="episodes per slot per round (simulation)")
    p.add_argument("--env_steps", type=int, default=50,
                   help="environment latency per turn in decode steps (simulation)")
    p.add_argument("--layers", type=int, default=0, help="override the number of layers (0 = as configured)")
    p.add_argument("--layers_impl", choices=("unroll", "scan"), default="unroll",
                   help="decode step with unrolled layers and per-layer pools (the engine's) or a scan over "
                        "layers on one stacked pool (lopd_jax.rollout.paged_step.paged_forward_scan)")
    p.add_argument("--rule", action="append", default=[], help="training-mesh logical-axis rule remap (repeatable)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--rl_step", action="store_true",
                   help="instead: model the whole RL step, sync against async (lopd_jax.programs.compile_rl_step); "
                        "nothing is compiled")
    p.add_argument("--mfu", type=float, default=0.4, help="--rl_step: the LOPD step's model FLOPs utilisation")
    p.add_argument("--rl_steps", type=int, default=24, help="--rl_step: RL steps simulated per seed")
    p.add_argument("--rl_seeds", type=int, default=3, help="--rl_step: episode streams averaged")
    p.add_argument("--host_chunk_ms", type=float, default=HOST_CHUNK_MS,
                   help="--rl_step: the engine's host milliseconds per decode chunk that no device work overlaps "
                        "(default: measured by python -m benchmarks.host_time)")
    p.add_argument("--host_step_s", type=float, default=HOST_STEP_S,
                   help="--rl_step: the trainer's host seconds per step (batch building) that no device work "
                        "overlaps (default: measured by python -m benchmarks.host_time)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key=value, as for lopd_jax.train")
    return p.parse_args(argv)


def print_report(r: dict) -> None:
    """The human-readable report."""

    s, es, ss = r["sizing"], r["sizing"]["engine_sim"], r["sizing"]["static_sim"]
    if "reason" in r:
        print(f"engine  config={r['config']}  topology={r['topology']} ({r['chips']} chips, {r['processes']} "
              f"processes)  slots {s['slots']}  in flight {s['in_flight']}  pages {s['pages']:,} x {s['page_size']}"
              f" (rule {s['pages_rule']:,}; engine.num_pages x processes {s['pages_configured']:,})\n  {r['reason']}")
        return
    print(f"engine  config={r['config']}  topology={r['topology']} ({r['chips']} chips, {r['processes']} processes)  "
          f"training mesh {r['train_mesh']}  compile {r['compile_s']} ({r['layers_impl']} layers)  attention "
          f"kernels {r['attention_kernels']}")
    print(f"  engine per process: {r['engine_devices']} devices, mesh data={r['data']} x tensor={r['tensor']}, "
          f"{r['dtype']}, {r['slots_compiled']} slots, {r['pages_compiled']:,} pages, {r['decode_steps_per_call']} "
          f"decode steps per call; reshard output: {r['reshard_layout']}")
    print(f"  slots {s['slots']}  in flight {s['in_flight']}  pages {s['pages']:,} x {s['page_size']} tokens "
          f"({s['pages_from']}; rule 1.25 x p99 live + 1 per episode: {s['pages_rule']:,}; engine.num_pages x "
          f"processes: {s['pages_configured']:,})  live tokens mean "
          f"{es['live_tokens_mean']:,.0f} p99 {es['live_tokens_p99']:,.0f}  utilisation engine "
          f"{es['utilisation']:.3f} (steady {es['steady_utilisation']:.3f}) static {ss['utilisation']:.3f} "
          f"({s['episodes']} episodes, {s['max_total_tokens']:,}-token cap)")
    m = r["per_chip_gib"]
    print(memory_line({k: v for k, v in m.items() if k not in ("trainer_params", "engine_total")}, None,
                      "decode call per chip GiB"))
    print(f"  + trainer's resident params {m['trainer_params']:.2f} = {m['engine_total']:.2f} GiB per chip"
          + (f" of {r['hbm_gib']}" if r["hbm_gib"] else ""))
    d, rs = r["decode_step"], r["reshard"]
    if "engine_step_bytes" in d:
        print(f"  HBM per decode step per chip: engine {_gib(d['engine_step_bytes']):.2f} GiB, bound "
              f"{_gib(d['bound_step_bytes']):.2f} GiB, static dense {_gib(d['static_step_bytes']):.2f} GiB "
              f"(XLA's estimate for the compiled call: {_gib(d['xla_bytes_accessed_per_chip']):.2f} GiB)")
        print(f"  reshard per RL step per chip: read {_gib(rs['hbm_read']):.2f} GiB, write "
              f"{_gib(rs['hbm_written']):.2f} GiB, ICI {_gib(rs['ici_received']):.2f} GiB -> roofline "
              f"{1e3 * rs['seconds']:.2f} ms")
        ratio = d["engine_us_per_token"] / d["bound_us_per_token"]
        gain = d["static_us_per_token"] / d["engine_us_per_token"]
        print(f"  roofline per useful token: engine {d['engine_us_per_token']:.2f} us, static dense sampler "
              f"{d['static_us_per_token']:.2f} us, bound {d['bound_us_per_token']:.2f} us -> engine / bound = "
              f"{ratio:.2f}x (target <= 1.5x), static / engine = {gain:.1f}x")


def rl_step_main(args) -> int:
    """``--rl_step``: the RL-step model's table and verdict line (exit codes as :func:`main`'s)."""
    if not 0 < args.mfu <= 1 or args.rl_steps < 4 or args.rl_seeds < 1 or min(args.host_chunk_ms,
                                                                              args.host_step_s) < 0:
        print(f"error: --mfu in (0, 1], --rl_steps >= 4, --rl_seeds >= 1, --host_chunk_ms and --host_step_s >= 0 "
              f"(got {args.mfu}, {args.rl_steps}, {args.rl_seeds}, {args.host_chunk_ms}, {args.host_step_s})",
              file=sys.stderr)
        return EXIT_BAD_ARGS
    rep, code = exit_on_error(ERROR_EXITS, lambda: rl_report(run_config(args), args.topology, args.mfu,
                                                             args.env_steps, args.rl_steps, args.rl_seeds,
                                                             args.host_chunk_ms, args.host_step_s))
    if code is not None:
        return code
    print_rl_report(rep, args.config, args.topology)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


def main(argv=None) -> int:
    """Entry point: print the report; exit 1 when the engine does not fit."""

    args = parse_args(argv)
    if args.rl_step:
        return rl_step_main(args)
    r, code = exit_on_error(ERROR_EXITS, run, args)
    if code is not None:
        return code
    print_report(r)
    return verdict(r, args.json)

