"""Rollout throughput: trajectories per minute on the synthetic family (tiny config, CPU).

The policy is ``tiny_qwen3`` with random weights and the tiny Qwen3-format tokenizer
(``lopd_jax.programs.evaluate.load_policy("tiny")``), sampling with the method's defaults
(temperature 0.7, top-p 0.95, top-k 20). A random policy rarely closes a turn, so turns
usually run to ``--max_turn_tokens``; the numbers are an upper bound on the per-token cost
of a real rollout's host + device loop. Rollouts run on the engine (``--slots`` decode
slots, ``--decode_chunk`` steps per call). The first round includes compilation; later
rounds reuse the compiled page widths.

    python -m benchmarks.bench_rollout --batch 32 --slots 32 --rounds 2 --max_turn_tokens 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402

from lopd_jax.chat.formats import make_chat_format  # noqa: E402
from lopd_jax.envs.synthetic.env import SyntheticTaskSource  # noqa: E402
from lopd_jax.programs.evaluate import load_policy  # noqa: E402
from lopd_jax.rollout.engine import Engine
from lopd_jax.settings.sections import EngineConfig, RolloutConfig, SamplingParams  # noqa: E402
from lopd_jax.rollout.episodes import rollout  # noqa: E402


def main(argv=None):
    """Run the benchmark and print the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max_turn_tokens", type=int, default=256)
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--env_workers", type=int, default=0)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--decode_chunk", type=int, default=16)
    args = p.parse_args(argv)

    model, tok, family = load_policy("tiny", seed=0)
    fmt = make_chat_format(family, tok)
    source = SyntheticTaskSource()
    tasks = source.tasks("train")
    engine = Engine(model, stop_ids=fmt.stop_ids, sampling=SamplingParams(), pad_id=tok.pad_token_id,
                    config=EngineConfig(slots=args.slots, decode_chunk=args.decode_chunk, env_workers=args.env_workers))
    params = Engine.params_of(model)
    config = RolloutConfig(max_env_steps=args.max_steps, max_turn_tokens=args.max_turn_tokens)
    print(f"tiny_qwen3 ({model.cfg.num_params() / 1e6:.2f}M params, vocab {model.cfg.vocab_size}); "
          f"batch {args.batch}; {args.slots} slots; max_turn_tokens {args.max_turn_tokens}")
    for r in range(args.rounds):
        batch = [tasks[(r * args.batch + i) % len(tasks)] for i in range(args.batch)]
        t0 = time.perf_counter()
        trajs = rollout(engine, params, fmt, source.make_env, batch, jax.random.key(r), config)
        dt = time.perf_counter() - t0
        gen = sum(sum(t.turn_lengths) for t in trajs)
        print(f"round {r}: {60 * len(trajs) / dt:7.1f} trajectories/min  ({dt:.1f} s; "
              f"{np.mean([t.num_turns for t in trajs]):.2f} turns, {gen / dt:.0f} generated tok/s, "
              f"mean length {np.mean([len(t) for t in trajs]):.0f} tokens, "
              f"mean reward {np.mean([t.reward for t in trajs]):.3f}; slot utilisation "
              f"{engine.metrics['utilisation']:.2f})")


if __name__ == "__main__":
    main()
