"""Continuous batching (lopd_jax/rollout/engine.py, which every rollout runs on) vs a static lockstep
schedule (benchmarks/static_sampler.py, driven turn by turn) on one multi-turn workload, CPU.

Episodes come from the length model's turn distribution scaled by ``--scale``, turn lengths
forced with per-row caps, observations from a scripted environment. **static**: batches of
``slots`` rows, one ``Sampler.extend`` per turn; **engine**: ``slots`` decode rows, ``--chunk``
steps per call, refilled as turns end, environments on a thread pool, paged cache. Same tiny
random Qwen3 and sampling on both; nothing compiles inside a timing. Prints useful tokens/s
and slot utilisation for each.

    python -m benchmarks.bench_engine --slots 8 32 --episodes_per_slot 2

Workload details and measurements: ``docs/engine.md``, "Benchmark".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models.config import qwen3  # noqa: E402
from models.decoder import Decoder  # noqa: E402
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.episode_spec import EpisodeSpec
from lopd_jax.settings.sections import EngineConfig, SamplingParams  # noqa: E402
from benchmarks.static_sampler import BucketConfig, Sampler

VOCAB = 512


def workload(n: int, scale: float, seed: int):
    """Episodes: (prompt ids, per-turn caps, observation ids per turn), plus the caps."""
    rs = np.random.RandomState(seed)
    max_turn = max(1, int(2048 * scale))
    max_total = max(64, int(40_960 * scale))
    eps = []
    for _ in range(n):
        turns = int(min(rs.geometric(1 / 8), 30))
        lens = np.clip(np.round(rs.lognormal(np.log(300 * scale), 1.0, turns)), 1, max(1, 10_000 * scale))
        obs = np.clip(np.round(rs.lognormal(np.log(150 * scale), 1.0, turns)), 1, None).astype(int)
        prompt = rs.randint(1, VOCAB, size=rs.randint(16, 48)).tolist()
        eps.append((prompt, [int(x) for x in lens], [rs.randint(1, VOCAB, size=k).tolist() for k in obs]))
    return eps, max_turn, max_total


def run_static(sampler, params, eps, slots, max_turn, max_total, rng):
    """The static schedule; returns (generated tokens, useful decode steps, decode slot-steps)."""
    useful = steps = gen_total = 0
    for lo in range(0, len(eps), slots):
        group = eps[lo:lo + slots]
        ctx = [list(p) for p, _, _ in group]
        pending = [list(p) for p, _, _ in group]
        turn = [0] * len(group)
        rows = list(range(len(group)))
        cache = sampler.new_cache(len(rows))
        t = 0
        while any(r is not None for r in rows):
            chunks = [None if i is None else pending[i] for i in rows]
            caps = [0 if i is None else max(1, min(max_turn, max_total - len(ctx[i]), group[i][1][turn[i]]))
                    for i in rows]
            gen, cache = sampler.extend(params, cache, chunks, caps, jax.random.fold_in(rng, lo * 1000 + t))
            t += 1
            n = [len(x) for x in gen.tokens if x is not None]
            gen_total += sum(n)
            useful += sum(k - 1 for k in n)
            steps += cache.batch * (max(n) - 1)
            for r, i in enumerate(rows):
                if i is None:
                    continue
                ids = gen.tokens[r].tolist()
                ctx[i] += ids
                turn[i] += 1
                obs = group[i][2][turn[i] - 1] if turn[i] < len(group[i][1]) else None
                if obs is None or len(ctx[i]) + len(obs) >= max_total:
                    rows[r] = None
                    continue
                ctx[i] += obs
                pending[i] = [ids[-1]] + obs
            live = [r for r, i in enumerate(rows) if i is not None]
            if live and sampler.batch_bucket(len(live)) < cache.batch:
                cache = sampler.compact(cache, live)
                rows = [rows[r] for r in live] + [None] * (cache.batch - len(live))
    return gen_total, useful, steps


def engine_specs(eps, max_turn, max_total):
    """EpisodeSpecs with the drawn turn caps and a scripted environment."""
    def stepper(prompt, lens, obs):
        state = {"t": 0, "n": len(prompt)}

        def step(ids, lps, raws):
            state["t"] += 1
            state["n"] += len(ids)
            if state["t"] >= len(lens) or state["n"] + len(obs[state["t"] - 1]) >= max_total:
                return None
            state["n"] += len(obs[state["t"] - 1])
            return obs[state["t"] - 1]
        return step

    return [EpisodeSpec(prompt, max_total, max_turn, stepper(prompt, lens, obs), turn_caps=lens)
            for prompt, lens, obs in eps]


def main(argv=None):
    """Run the benchmark and print the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[8, 32])
    p.add_argument("--episodes_per_slot", type=int, default=2)
    p.add_argument("--scale", type=float, default=0.05, help="token-length scale of the workload")
    p.add_argument("--chunk", type=int, default=8, help="engine decode steps per device call")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--prefill_chunk", type=int, default=32, help="engine prefill tokens per row per call")
    args = p.parse_args(argv)

    cfg = qwen3(64, 128, 2, 4, 2, tie=False, vocab=VOCAB, head_dim=16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = Sampler.params_of(model)
    sp = SamplingParams()
    print(f"model: qwen3-style {cfg.num_params() / 1e6:.2f}M params, vocab {VOCAB}; scale {args.scale}; "
          f"engine chunk {args.chunk}, page {args.page_size}")
    last = None
    for slots in args.slots:
        n = slots * args.episodes_per_slot
        sampler = Sampler(model, stop_ids=(), sampling=sp, buckets=BucketConfig(batch=(slots,)))
        engine = Engine(model, stop_ids=(), sampling=sp,
                        config=EngineConfig(slots=slots, page_size=args.page_size, decode_chunk=args.chunk,
                                            prefill_chunk=args.prefill_chunk, env_workers=4))
        res = {}
        engine.precompile(params, workload(n, args.scale, 0)[2])
        for name in ("static", "engine"):
            for seed in (0, 0) if name == "static" else (0,):  # static: a warm-up round compiles its shapes
                eps, max_turn, max_total = workload(n, args.scale, seed)
                t0 = time.perf_counter()
                if name == "static":
                    gen, useful, steps = run_static(sampler, params, eps, slots, max_turn, max_total,
                                                    jax.random.key(seed))
                else:
                    out = engine.run(params, engine_specs(eps, max_turn, max_total), jax.random.key(seed))
                    gen = sum(len(t) for r in out for t in r.turns)
                    useful, steps = engine.metrics["useful_slot_steps"], engine.metrics["slot_steps"]
                dt = time.perf_counter() - t0
            res[name] = (gen / dt, useful / max(steps, 1))
            rows = (f", rows computed / slot-steps {engine.metrics['row_steps'] / max(steps, 1):.3f}"
                    if name == "engine" else "")
            print(f"slots {slots:3d} {name:6s}: {n} episodes, {gen} generated tokens in {dt:6.2f} s = "
                  f"{gen / dt:8.1f} useful tok/s, slot utilisation {useful / max(steps, 1):.3f}{rows}", flush=True)
        ratio = res["engine"][0] / res["static"][0]
        print(f"slots {slots:3d}: continuous/static useful tokens/s = {ratio:.2f}x")
        last = (ratio, res["static"][1], res["engine"][1])
    print(f"engine: continuous/static useful tokens/s = {last[0]:.2f}x (utilisation {last[1]:.2f} -> {last[2]:.2f})")


if __name__ == "__main__":
    main()
