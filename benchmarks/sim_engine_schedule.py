"""Slot utilisation at production scale: the static schedule vs the engine's, simulated.

Episodes come from the run config's length distribution (``lengths``) with the production caps;
:mod:`lopd_jax.planning.engine_schedule` runs both schedules on the same episodes, in decode steps: static
(``slots`` rows in lockstep) and engine (``slots`` rows refilled FIFO, ``in_flight`` episodes,
``--chunk`` decode chunks, ``--env_steps`` environment latency per turn). Utilisation = useful
decode slot-steps / decode slot-steps (as ``Engine.metrics`` counts); ``steady`` is the engine's
until the round's last episode starts, before the drain that more episodes per round amortise.
Live tokens (what the page pool must hold) are per slice.

    python -m benchmarks.sim_engine_schedule --slots 32 256 --episodes_per_slot 8 32

Measurements: ``docs/engine.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

from lopd_jax.planning.engine_schedule import draw_episodes, pool_pages, simulate_engine, simulate_static  # noqa: E402
from lopd_jax.settings.length_config import LengthConfig  # noqa: E402


def main(argv=None) -> None:
    """Print one row per (slots, episodes per slot, in flight) and a closing summary line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[32, 256])
    p.add_argument("--episodes_per_slot", type=int, nargs="+", default=[8, 32])
    p.add_argument("--in_flight", type=float, nargs="+", default=[2.0], help="episodes in flight per slot")
    p.add_argument("--chunk", type=int, default=16, help="decode steps per device call (K)")
    p.add_argument("--env_steps", type=int, default=50, help="environment latency per turn, in decode steps")
    p.add_argument("--page_size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    lc = LengthConfig()
    print(f"chunk {a.chunk}, env latency {a.env_steps} steps, pages of {a.page_size}; "
          "utilisation = useful / slot-steps")
    print("| slots | episodes | in flight | static | engine | engine steady | live tokens mean / p99 "
          "| pool pages (rule) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    last = None
    for slots in a.slots:
        for per in a.episodes_per_slot:
            eps = draw_episodes(lc, per * slots, 30, 10_000, 40_960, seed=a.seed)
            st = simulate_static(eps, slots, a.env_steps)
            for f in a.in_flight:
                inf = int(f * slots)
                en = simulate_engine(eps, slots, inf, a.chunk, a.env_steps)
                pages = pool_pages(en["live_tokens_p99"], inf, a.page_size, 40_960)
                print(f"| {slots} | {len(eps)} | {inf} | {st['utilisation']:.3f} | {en['utilisation']:.3f} | "
                      f"{en['steady_utilisation']:.3f} | {en['live_tokens_mean']:,.0f} / "
                      f"{en['live_tokens_p99']:,.0f} | {pages:,} |")
                last = (slots, st["utilisation"], en["utilisation"])
    print(f"engine schedule at {last[0]} slots: utilisation {last[1]:.3f} static -> {last[2]:.3f} engine")


if __name__ == "__main__":
    main()
