"""A schedule model of the rollout engine and of the static sampler it replaces.

Time is counted in decode steps. Episodes are drawn from the run's length distribution
(:class:`lopd_jax.settings.length_config.LengthConfig`) with the rollout's caps applied as the
rollout applies them. :func:`simulate_engine` models the engine's policy (slots refilled FIFO,
``in_flight`` episodes, decode chunks, environment latency holding pages but no slot);
:func:`simulate_static` models lockstep batches whose turns last until the longest live one.
Both return utilisation (useful slot-steps over slot-steps, as the engine's metrics count) and
time utilisation; the engine also its steady utilisation, decode context per call and live
tokens, which size the page pool (:func:`pool_pages`).

Why and what it predicts: ``docs/engine.md`` (``benchmarks.sim_engine_schedule``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq

import numpy as np

from lopd_jax.settings.length_config import LengthConfig

__all__ = ["Episode", "draw_episodes", "pool_pages", "simulate_engine", "simulate_static"]


@dataclasses.dataclass(frozen=True)
class Episode:
    """Token counts of one episode: prompt, generated per turn, observation after each turn
    but the last."""

    prompt: int
    turns: tuple[int, ...]
    obs: tuple[int, ...]

    @property
    def total(self) -> int:
        """Context length at the end."""
        return self.prompt + sum(self.turns) + sum(self.obs)


def draw_episodes(lc: LengthConfig, n: int, max_turns: int, max_turn_tokens: int, max_total_tokens: int,
                  seed: int = 0) -> list[Episode]:
    """``n`` episodes from ``lc``'s distribution with the rollout's caps applied."""
    rng = np.random.default_rng(seed)
    ln = lambda med, sig, size=None: np.exp(np.log(med) + sig * rng.standard_normal(size))
    out = []
    for _ in range(n):
        k = int(min(rng.geometric(1.0 / lc.turns_mean), max_turns))
        prompt = int(min(np.ceil(ln(lc.prompt_median, lc.prompt_sigma)), max_total_tokens // 2))
        turns, obs, ctx = [], [], prompt
        for j in range(k):
            med = lc.first_turn_median if j == 0 and lc.first_turn_median > 0 else lc.turn_median
            t = int(max(1, min(np.ceil(ln(med, lc.turn_sigma)), max_turn_tokens, max_total_tokens - ctx)))
            turns.append(t)
            ctx += t
            if j == k - 1 or ctx >= max_total_tokens:
                break
            o = int(max(1, np.ceil(ln(lc.obs_median, lc.obs_sigma))))
            if ctx + o >= max_total_tokens - 1:  # no room for another turn: the episode ends
                break
            obs.append(o)
            ctx += o
        out.append(Episode(prompt, tuple(turns), tuple(obs)))
    return out


def simulate_engine(eps: list[Episode], slots: int, in_flight: int, chunk: int, env_steps: int) -> dict:
    """The engine's schedule on ``eps`` (in order); see the module docstring."""
    queue = collections.deque(range(len(eps)))
    ready: collections.deque = collections.deque()  # (episode, turn index)
    env: list = []  # heap of (ready time, episode, next turn)
    ctx = [0] * len(eps)
    slot = [None] * slots  # (episode, turn, tokens left)
    started = done = 0
    t = useful = slot_steps = 0
    steady = None  # (useful, slot-steps) when the last episode starts: the round's drain follows
    running = chunks = 0  # context of the decoding rows, summed over rows and decode calls
    live_samples = []
    while done < len(eps):
        while env and env[0][0] <= t:
            _, e, j = heapq.heappop(env)
            ready.append((e, j))
        while queue and started - done < in_flight:
            e = queue.popleft()
            started += 1
            ctx[e] = eps[e].prompt
            ready.append((e, 0))
        if not queue and steady is None:
            steady = (useful, slot_steps)
        for s in range(slots):
            if slot[s] is None and ready:
                e, j = ready.popleft()
                slot[s] = (e, j, eps[e].turns[j])
        if all(x is None for x in slot):
            t = max(t, env[0][0]) if env else t  # nothing to decode: wait for an environment
            continue
        live_samples.append(sum(ctx))  # not started and finished episodes count 0
        running += sum(ctx[x[0]] for x in slot if x is not None)
        chunks += 1
        for s in range(slots):
            if slot[s] is None:
                continue
            e, j, left = slot[s]
            g = min(chunk, left)
            useful += g
            ctx[e] += g
            if g < left:
                slot[s] = (e, j, left - g)
                continue
            slot[s] = None
            if j + 1 < len(eps[e].turns):
                ctx[e] += eps[e].obs[j]
                heapq.heappush(env, (t + chunk + env_steps, e, j + 1))
            else:
                ctx[e] = 0  # finished: its pages go back to the pool
                done += 1
        slot_steps += slots * chunk
        t += chunk
    live = np.asarray(live_samples, np.float64)
    steady = steady or (0, 0)  # (0, 0): every episode started before the first decode call (nan)
    return {"utilisation": useful / max(slot_steps, 1), "time_utilisation": useful / max(slots * t, 1),
            "steady_utilisation": steady[0] / steady[1] if steady[1] else float("nan"),
            "steps": t, "useful": useful, "running_tokens_mean": running / max(chunks, 1),
            "live_tokens_mean": float(live.mean()),
            "live_tokens_p99": float(np.percentile(live, 99)), "live_tokens_max": float(live.max())}


def simulate_static(eps: list[Episode], rows: int, env_steps: int) -> dict:
    """The static lockstep schedule on ``eps`` in batches of ``rows``."""
    t = useful = slot_steps = 0
    for b in range(0, len(eps), rows):
        batch = eps[b:b + rows]
        for j in range(max(len(e.turns) for e in batch)):
            lens = [e.turns[j] for e in batch if j < len(e.turns)]
            steps = max(lens)
            useful += sum(lens)
            slot_steps += rows * steps
            t += steps + (env_steps if any(j + 1 < len(e.turns) for e in batch) else 0)
    return {"utilisation": useful / max(slot_steps, 1), "time_utilisation": useful / max(rows * t, 1),
            "steps": t, "useful": useful}


def pool_pages(live_tokens_p99: float, in_flight: int, page_size: int, max_total_tokens: int,
               headroom: float = 1.25) -> int:
    """The page-pool rule: ``headroom`` x the 99th percentile of live tokens (simulated),
    plus one partly filled page per episode in flight, and never less than one episode at
    the cap (the engine's own minimum). A pool this size rarely fills; when it does the
    engine makes the head of the queue wait or preempts the newest episode."""
    pages = int(np.ceil(headroom * live_tokens_p99 / page_size)) + in_flight
    return max(pages, -(-max_total_tokens // page_size) + 1)
