"""A schedule model of the whole RL step in seconds: sampling, training and the weight sync,
synchronous (the paper's schedule) or asynchronous with bounded staleness.

It extends :mod:`lopd_jax.planning.engine_schedule` (one host's engine, time in decode steps) to
wall-clock seconds over many RL steps, so that the placement and the staleness bound of
an asynchronous run can be chosen before renting a slice. ``python -m
lopd_jax.compile_sampler --rl_step`` feeds it the decode-step and reshard times of the
slice and the LOPD step's estimate; docs/rl_step.md gives the policies it models and the
numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Iterator, Literal

import numpy as np

from lopd_jax.planning.engine_schedule import Episode

__all__ = ["RLStepTimes", "RLSchedule", "simulate_rl", "steps_per_hour"]


@dataclasses.dataclass(frozen=True)
class RLStepTimes:
    """Seconds of the parts of an RL step on the whole slice.

    ``decode_weights_s``: one decode step's fixed cost (reading the weight shard);
    ``decode_kv_s_per_token``: its cost per token of context of the decoding rows (the KV
    read), so a decode step over rows holding ``c`` tokens in all takes
    ``decode_weights_s + c * decode_kv_s_per_token``; ``train_s``: one training step on every
    chip; ``sync_s``: moving the new weights to the sampler (the reshard, or the transfer
    to a split sampler); ``env_s``: an environment's latency per turn. Host time that no
    device work overlaps (the chips idle meanwhile): ``host_chunk_s`` per decode chunk (the
    engine's Python between two chunks) and ``host_step_s`` per training step (building its
    batch); ``benchmarks/host_time.py`` measures both.
    """

    decode_weights_s: float
    decode_kv_s_per_token: float
    train_s: float
    sync_s: float
    env_s: float
    host_chunk_s: float = 0.0
    host_step_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class RLSchedule:
    """One host's share of the run's schedule.

    ``mode``: ``sync`` admits a step's batch, decodes it to its last episode, then trains
    (the paper); ``async`` keeps decoding across steps and trains on finished episodes.
    ``placement``: ``colocated`` (the same chips alternate: training pauses decoding) or
    ``split`` (``sampler_share`` of the hosts decode all the time beside a trainer on the
    rest; each sampler host then produces ``1 / sampler_share`` times the episodes and the
    trainer takes ``1 / (1 - sampler_share)`` times as long). ``batch``: episodes per step
    per host (whole groups of ``group_size``); ``slots``: decode rows per host;
    ``in_flight``: episodes started and not yet trained on, per host (0: twice the slots);
    ``max_staleness``: k, the most policy versions an episode's oldest token may lag the
    version it is trained under; ``stale``: ``drop`` restarts an episode that would exceed k
    (its tokens are wasted and counted), ``keep`` trains on it (importance-corrected).
    ``batches``: ``finished`` trains on the first groups to finish; ``step`` on step s's own
    groups, once all of them have finished (``rollout.batch_order=step``: the sampler keeps
    its slots full, the trainer still waits for a step's slowest episode); ``due`` is
    ``rollout.batch_order=finished`` as built: the groups due soonest first (a group started
    under version a trains by step a + k), then the first to finish; nothing is dropped.
    """

    mode: Literal["sync", "async"] = "sync"
    placement: Literal["colocated", "split"] = "colocated"
    sampler_share: float = 0.5
    batch: int = 8
    group_size: int = 1
    slots: int = 64
    in_flight: int = 0
    max_staleness: int = 1
    stale: Literal["drop", "keep"] = "drop"
    chunk: int = 16
    batches: Literal["finished", "step", "due"] = "finished"

    def __post_init__(self):
        if self.mode not in ("sync", "async") or self.placement not in ("colocated", "split"):
            raise ValueError(f"mode {self.mode!r} / placement {self.placement!r}: use sync|async, colocated|split")
        if self.placement == "split" and not 0 < self.sampler_share < 1:
            raise ValueError(f"sampler_share={self.sampler_share}: a split slice needs a share in (0, 1)")
        if self.batch % self.group_size:
            raise ValueError(f"batch {self.batch} is not whole groups of {self.group_size}")
        if self.batches not in ("finished", "step", "due"):
            raise ValueError(f"batches={self.batches!r}: use finished|step|due")
        if self.max_staleness < 0 or self.stale not in ("drop", "keep"):
            raise ValueError(f"max_staleness={self.max_staleness}, stale={self.stale!r}: k >= 0, drop|keep")


def simulate_rl(episodes: Iterator[Episode], sched: RLSchedule, times: RLStepTimes, steps: int,
                warmup_steps: int = 2) -> dict:
    """Simulate ``steps`` RL steps of one host (hosts are alike); figures after ``warmup_steps``.

    Episodes come from ``episodes`` in order, ``group_size`` at a time (one task's group).
    Returns seconds per step, the sampler's busy rows per decode step, the share of wall
    time the chips compute nothing, staleness (versions, per trained episode: mean, p95,
    max) and the episodes and tokens dropped per step.
    """
    split = sched.placement == "split"
    share = sched.sampler_share if split else 1.0
    batch = int(round(sched.batch / share)) if split else sched.batch  # a sampler host's quota
    batch = max(sched.group_size, batch - batch % sched.group_size)
    train_s = (times.train_s / (1 - share) if split else times.train_s) + times.host_step_s
    g = sched.group_size
    k = 0 if sched.mode == "sync" else sched.max_staleness
    cap = batch if k == 0 else max(sched.in_flight or 2 * sched.slots, batch)  # k = 0: a batch at a time
    live: dict[int, list] = {}  # id -> [episode, group, version of its oldest token, context tokens]
    finished: set[int] = set()  # finished, not yet trained on
    group_left: dict[int, int] = {}  # members of a group not finished
    members: dict[int, list[int]] = collections.defaultdict(list)
    ready_groups: collections.deque = collections.deque()  # groups whose members all finished
    ready: collections.deque = collections.deque()  # (id, turn) waiting for a slot
    env: list = []  # heap of (ready time, id, next turn)
    slot: list = [None] * sched.slots  # (id, turn, tokens left)
    t = decode_time = compute_time = 0.0
    version = groups = next_id = dropped = dropped_tokens = 0
    trainer_free, new_weights = 0.0, None  # split: the trainer's current step, the weights it made
    step_ends: list[float] = []
    staleness: list[int] = []
    busy_rows: list[int] = []

    def start(gid: int) -> None:
        nonlocal next_id
        ep = next(episodes)
        live[next_id] = [ep, gid, version, ep.prompt]
        members[gid].append(next_id)
        ready.append((next_id, 0))
        next_id += 1

    def admit() -> None:
        """Start whole groups while in flight stays under the cap and started episodes under
        (version + k + 1) batches (no episode can then be more than k versions old when
        its batch is taken, unless it outlives later ones)."""
        nonlocal groups
        while len(live) + g <= cap and (groups + 1) * g <= (version + k + 1) * batch:
            group_left[groups] = g
            for _ in range(g):
                start(groups)
            groups += 1

    def drop_stale() -> None:
        """``drop``: restart every untrained episode whose oldest token is more than k behind."""
        nonlocal dropped, dropped_tokens
        for eid in [e for e, x in live.items() if version - x[2] > k]:
            ep, gid, _, ctx = live.pop(eid)
            dropped += 1
            dropped_tokens += ctx - ep.prompt  # its generated tokens and observations so far
            for s, x in enumerate(slot):
                if x is not None and x[0] == eid:
                    slot[s] = None
            members[gid].remove(eid)
            if eid in finished:
                finished.discard(eid)
                group_left[gid] += 1
                if gid in ready_groups:
                    ready_groups.remove(gid)
            start(gid)
        kept = [x for x in ready if x[0] in live]
        ready.clear()
        ready.extend(kept)
        env[:] = [x for x in env if x[1] in live]
        heapq.heapify(env)

    def due_batch() -> list[int] | None:
        """``due``: the groups due soonest (started under version a: due by a + k) as far as
        later steps need, then the first to finish (ready_groups is in finish order)."""
        q, done = batch // g, list(ready_groups)
        start_version = {gid: live[ids[0]][2] for gid, ids in members.items()}
        chosen: list[int] = []
        for t in range(version, version + k + 1):
            pool = [gid for gid, v in start_version.items() if v + k <= t]
            need = len(pool) - (t - version) * q
            have = sum(start_version[gid] + k <= t for gid in chosen)
            if need > have:
                cands = [gid for gid in done if gid in pool and gid not in chosen]
                if len(cands) < need - have:
                    return None
                chosen += cands[:need - have]
        chosen += [gid for gid in done if gid not in chosen][:q - len(chosen)]
        return chosen if len(chosen) == q else None

    def take_batch() -> bool:
        """Train on the oldest ready groups if they make a batch (``step``: on the next step's
        groups once all are ready); their episodes leave."""
        if sched.batches == "step":
            need = list(range(version * (batch // g), (version + 1) * (batch // g)))
            if not set(need) <= set(ready_groups):
                return False
            for gid in need:
                ready_groups.remove(gid)
        elif sched.batches == "due":
            need = due_batch()
            if need is None:
                return False
            for gid in need:
                ready_groups.remove(gid)
        elif len(ready_groups) * g < batch:
            return False
        else:
            need = [ready_groups.popleft() for _ in range(batch // g)]
        for gid in need:
            for eid in members.pop(gid):
                staleness.append(version - live.pop(eid)[2])
                finished.discard(eid)
        return True

    def bump(at: float) -> None:
        nonlocal version
        version += 1
        step_ends.append(at)
        if sched.stale == "drop" and k > 0:
            drop_stale()
        admit()

    admit()
    while len(step_ends) < steps:
        if split:
            if new_weights is not None and t >= new_weights:  # the sampler takes the new weights
                t = new_weights + times.sync_s
                new_weights = None
                bump(t)
                continue
            if new_weights is None and t >= trainer_free and take_batch():
                trainer_free = new_weights = t + train_s
        elif take_batch():  # the same chips: decoding pauses for the step and the reshard
            t += train_s + times.sync_s
            compute_time += train_s - times.host_step_s + times.sync_s
            bump(t)
            continue
        while env and env[0][0] <= t:
            _, eid, turn = heapq.heappop(env)
            ready.append((eid, turn))
        for s in range(sched.slots):
            if slot[s] is None and ready:
                eid, turn = ready.popleft()
                slot[s] = (eid, turn, live[eid][0].turns[turn])
        rows = [x for x in slot if x is not None]
        if not rows:  # nothing to decode: wait for an environment, the trainer or new weights
            nxt = [env[0][0]] if env else []
            nxt += [new_weights] if new_weights is not None else []
            nxt += [trainer_free] if split and trainer_free > t and len(ready_groups) * g >= batch else []
            if not nxt:
                raise RuntimeError("the schedule stalled: in_flight holds less than one batch, or a bug")
            t = max(t, min(nxt))
            continue
        context = sum(live[x[0]][3] for x in rows)
        on_chips = sched.chunk * (times.decode_weights_s + context * times.decode_kv_s_per_token)
        dt = on_chips + times.host_chunk_s
        busy_rows.append(len(rows))
        decode_time += on_chips
        for s in range(sched.slots):
            if slot[s] is None:
                continue
            eid, turn, left = slot[s]
            x = live[eid]
            n = min(sched.chunk, left)
            x[3] += n
            if n < left:
                slot[s] = (eid, turn, left - n)
                continue
            slot[s] = None
            ep = x[0]
            if turn + 1 < len(ep.turns):
                x[3] += ep.obs[turn]
                heapq.heappush(env, (t + dt + times.env_s, eid, turn + 1))
            else:
                finished.add(eid)
                group_left[x[1]] -= 1
                if group_left[x[1]] == 0:
                    ready_groups.append(x[1])
        t += dt
        admit()
    ends = np.asarray(step_ends)
    w = min(warmup_steps, steps - 2)
    per_step = float(np.diff(ends[w:]).mean()) if steps > 1 else float(ends[-1])
    st = np.asarray(staleness[w * batch:] or [0])
    wall = float(ends[-1])
    if split:  # idle is what neither side does, weighted by its share of the chips
        idle = share * (1 - decode_time / wall) + (1 - share) * (1 - min(1.0, steps * (train_s - times.host_step_s)
                                                                          / wall))
    else:
        idle = max(0.0, 1 - (compute_time + decode_time) / wall)
    return {"seconds_per_step": per_step, "busy_rows": float(np.mean(busy_rows)) if busy_rows else 0.0,
            "chips_idle": idle, "staleness_mean": float(st.mean()), "staleness_p95": float(np.percentile(st, 95)),
            "staleness_max": int(st.max()), "dropped_per_step": dropped / steps,
            "dropped_tokens_per_step": dropped_tokens / steps, "steps": steps, "wall_s": wall}


def steps_per_hour(result: dict) -> float:
    """RL steps per hour of a :func:`simulate_rl` result."""
    return 3600.0 / result["seconds_per_step"]
