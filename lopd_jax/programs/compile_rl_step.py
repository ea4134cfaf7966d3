"""The RL step at slice size, sync against async: ``python -m lopd_jax.compile_sampler --rl_step``.

Prices the parts of one RL step on the slice from the same sources as the compile checks
(the decode step's HBM bytes and the reshard's cost as ``compile_sampler`` counts them, the
LOPD step's length-bucketed estimate as ``compile_check`` makes it, at a stated MFU) and
runs the schedule model (:mod:`lopd_jax.planning.rl_schedule`) for the synchronous schedule
and the asynchronous one at several staleness bounds and placements. Nothing is compiled;
docs/rl_step.md explains the model and its numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

import numpy as np

from lopd_jax.programs import compile_check as cc
from lopd_jax.programs.compile_buckets import HBM_BANDWIDTH, ICI_BANDWIDTH, PEAK_FLOPS, length_report
from lopd_jax.rollout.layout import default_tensor, reshard_cost
from lopd_jax.planning.rl_schedule import RLSchedule, RLStepTimes, simulate_rl, steps_per_hour
from lopd_jax.planning.engine_schedule import Episode, draw_episodes

#: (placement, sampler share) pairs compared; ``split`` puts that share of the hosts on sampling
#: (not built). The colocated rows are what ``rollout.partial=true`` builds: ``colocated`` with
#: ``rollout.batch_order=finished rollout.stale=restart`` (the first groups to finish; stale
#: ones restarted), ``partial-wait`` with ``stale=wait`` (the step waits for groups due) and
#: ``partial-step`` with ``batch_order=step`` (:class:`RLSchedule` ``batches`` finished / due / step)
PLACEMENTS = (("colocated", 1.0), ("partial-step", 1.0), ("partial-wait", 1.0), ("split", 0.25), ("split", 0.5))
BATCHES = {"partial-step": "step", "partial-wait": "due"}
BUILT = ("colocated", *BATCHES)
STALENESS = (0, 1, 2, 4)
#: host time no device work overlaps, measured by ``python -m benchmarks.host_time`` at the paper's
#: shapes with the device stubbed (docs/benchmarks.md, "Host time"): the engine's per decode chunk
#: and the trainer's batch building per step (``--host_chunk_ms`` / ``--host_step_s``)
HOST_CHUNK_MS = 0.50
HOST_STEP_S = 0.10


def episode_stream(cfg, seed: int) -> Iterator[Episode]:
    """Episodes of ``cfg``'s length distribution under its rollout caps, without end."""
    r = cfg.rollout.caps
    for i in itertools.count():
        yield from draw_episodes(cfg.lengths, 256, r.max_env_steps, r.max_turn_tokens, r.max_total_tokens,
                                 seed=seed * 100_003 + i)


def step_times(cfg, topology: str, mfu: float, env_steps: int, host_chunk_ms: float = 0.0,
               host_step_s: float = 0.0) -> tuple[RLStepTimes, dict]:
    """The RL step's parts in seconds on ``topology`` (see the module docstring), and what
    they came from; ``host_chunk_ms`` / ``host_step_s``: the host time not overlapped per
    decode chunk and per training step."""
    spec, layout = cc.step_inputs(cfg)
    devices, gen, _ = cc.topology_devices(topology)
    if gen not in PEAK_FLOPS or gen not in HBM_BANDWIDTH:
        raise ValueError(f"--rl_step needs a TPU topology with known peak FLOPs and bandwidth (got {gen!r})")
    chips = len(devices)
    processes = len({d.process_index for d in devices})
    mcfg = spec.model
    tensor = cfg.engine.tensor or default_tensor(mcfg, chips // processes)
    system = cc.build_system(spec, layout, devices)
    flops = cc.step_flops_fn("lopd", cfg, spec, system)
    est = length_report(cfg, spec, system, gen, chips, flops, compile_passes=False, kind="lopd")["estimate"]
    side = "packed" if cfg.lengths.packing else "bucketed" if cfg.lengths.enabled else "padded"
    at_peak = est[side]["seconds"]
    bw = HBM_BANDWIDTH[gen]
    weights = 2 * mcfg.num_params() / tensor  # the bf16 weight shard each decode step reads
    kv_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * 2 / min(tensor, mcfg.num_kv_heads)
    sync = reshard_cost(mcfg, chips, tensor, bw, ICI_BANDWIDTH[gen]).seconds
    times = RLStepTimes(decode_weights_s=weights / bw, decode_kv_s_per_token=kv_token / bw,
                        train_s=at_peak / mfu, sync_s=sync, env_s=env_steps * weights / bw,
                        host_chunk_s=host_chunk_ms / 1e3, host_step_s=host_step_s)
    source = {"chips": chips, "processes": processes, "tensor": tensor, "gen": gen, "train_s_at_peak": at_peak,
              "mfu": mfu, "env_steps": env_steps}
    return times, source


def compare(cfg, times: RLStepTimes, processes: int, steps: int, seeds: int) -> list[dict]:
    """Every (placement, k) against sync, averaged over ``seeds`` episode streams."""
    e = cfg.env
    batch = e.tasks_per_step * e.group_size // processes
    base = dict(batch=batch, group_size=e.group_size, slots=cfg.engine.slots, chunk=cfg.engine.decode_chunk,
                in_flight=cfg.engine.max_in_flight)
    rows = []
    for placement, share in PLACEMENTS:
        for k in STALENESS:
            if placement in BATCHES and k == 0:
                continue  # sync
            mode = "sync" if k == 0 else "async"
            sched = RLSchedule(mode=mode, placement="split" if placement == "split" else "colocated",
                               sampler_share=share if placement == "split" else 0.5, max_staleness=max(k, 1),
                               batches=BATCHES.get(placement, "finished"), **base)
            runs = [simulate_rl(episode_stream(cfg, cfg.seed + s), sched, times, steps) for s in range(seeds)]
            row = {key: float(np.mean([r[key] for r in runs])) for key in runs[0] if key not in ("steps",)}
            row |= {"placement": placement if placement != "split" else f"split {share:g}", "k": k,
                    "mode": mode, "steps_per_hour": float(np.mean([steps_per_hour(r) for r in runs]))}
            rows.append(row)
    sync = next(r for r in rows if r["placement"] == "colocated" and r["k"] == 0)
    for r in rows:
        r["ratio"] = r["steps_per_hour"] / sync["steps_per_hour"]
    return rows


def report(cfg, topology: str, mfu: float, env_steps: int, steps: int, seeds: int,
           host_chunk_ms: float = HOST_CHUNK_MS, host_step_s: float = HOST_STEP_S) -> dict:
    """The whole comparison: the step's parts (host time included) and every row."""
    times, source = step_times(cfg, topology, mfu, env_steps, host_chunk_ms, host_step_s)
    rows = compare(cfg, times, source["processes"], steps, seeds)
    return {"times": dataclasses.asdict(times), "source": source, "rows": rows, "steps": steps, "seeds": seeds}


def print_report(rep: dict, config: str, topology: str) -> None:
    """The table and the verdict line: the best setting ``rollout.partial`` builds with
    k <= 2 against sync (the ``colocated`` and ``split`` rows are policies not built)."""
    t, s = rep["times"], rep["source"]
    print(f"rl step model  config={config}  topology={topology} ({s['chips']} chips, {s['processes']} hosts)  "
          f"engine tensor {s['tensor']}")
    print(f"  decode step {1e3 * t['decode_weights_s']:.2f} ms + {1e9 * t['decode_kv_s_per_token']:.2f} ns per "
          f"context token; LOPD step {t['train_s']:.1f} s ({s['train_s_at_peak']:.2f} s at peak / MFU "
          f"{s['mfu']:.2f}); weight sync {1e3 * t['sync_s']:.1f} ms; environment {t['env_s']:.3f} s per turn "
          f"({s['env_steps']} decode steps); host not overlapped {1e3 * t.get('host_chunk_s', 0.0):.2f} ms per chunk, "
          f"{t.get('host_step_s', 0.0):.2f} s per step; {rep['steps']} steps x {rep['seeds']} seeds")
    print(f"  {'placement':<12}{'k':>3}  {'s/step':>8}  {'steps/h':>8}  {'ratio':>6}  {'busy rows':>9}  "
          f"{'chips idle':>10}  {'staleness mean/p95/max':>22}  {'dropped/step':>12}")
    for r in rep["rows"]:
        k = "sync" if r["k"] == 0 else r["k"]
        print(f"  {r['placement']:<12}{k!s:>3}  {r['seconds_per_step']:8.1f}  {r['steps_per_hour']:8.1f}  "
              f"{r['ratio']:5.2f}x  {r['busy_rows']:9.1f}  {r['chips_idle']:10.2f}  "
              f"{r['staleness_mean']:8.2f} / {r['staleness_p95']:4.1f} / {r['staleness_max']:4.1f}  "
              f"{r['dropped_per_step']:12.2f}")
    best = max((r for r in rep["rows"] if 1 <= r["k"] <= 2 and r["placement"] in BUILT), key=lambda r: r["ratio"])
    print(f"rl step model: async/sync steps per hour = {best['ratio']:.2f}x (k = {best['k']}, placement "
          f"{best['placement']})")  # the best of what rollout.partial builds


__all__ = ["BATCHES", "BUILT", "HOST_CHUNK_MS", "HOST_STEP_S",
           "PLACEMENTS", "STALENESS", "compare", "episode_stream", "print_report", "report", "step_times"]
