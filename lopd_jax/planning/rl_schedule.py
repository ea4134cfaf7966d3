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


class _RLSimulation:
    """One host's RL run in progress, for :func:`simulate_rl`: the episodes in flight, the
    decode slots, the environments' queue, the policy version and the clock, with one method
    per move of the schedule (admit groups, drop stale episodes, take a batch, bump the
    version, decode one chunk) and the figures of the run at the end."""

    def __init__(self, episodes: Iterator[Episode], sched: RLSchedule, times: RLStepTimes):
        self.episodes, self.sched, self.times = episodes, sched, times
        self.split = sched.placement == "split"
        self.share = sched.sampler_share if self.split else 1.0
        batch = int(round(sched.batch / self.share)) if self.split else sched.batch  # a sampler host's quota
        self.batch = max(sched.group_size, batch - batch % sched.group_size)
        self.train_s = (times.train_s / (1 - self.share) if self.split else times.train_s) + times.host_step_s
        self.g = sched.group_size
        self.k = 0 if sched.mode == "sync" else sched.max_staleness
        # k = 0: a batch at a time
        self.cap = self.batch if self.k == 0 else max(sched.in_flight or 2 * sched.slots, self.batch)
        self.live: dict[int, list] = {}  # id -> [episode, group, version of its oldest token, context tokens]
        self.finished: set[int] = set()  # finished, not yet trained on
        self.group_left: dict[int, int] = {}  # members of a group not finished
        self.members: dict[int, list[int]] = collections.defaultdict(list)
        self.ready_groups: collections.deque = collections.deque()  # groups whose members all finished
        self.ready: collections.deque = collections.deque()  # (id, turn) waiting for a slot
        self.env: list = []  # heap of (ready time, id, next turn)
        self.slot: list = [None] * sched.slots  # (id, turn, tokens left)
        self.t = self.decode_time = self.compute_time = 0.0
        self.version = self.groups = self.next_id = self.dropped = self.dropped_tokens = 0
        self.trainer_free, self.new_weights = 0.0, None  # split: the trainer's current step, the weights it made
        self.step_ends: list[float] = []
        self.staleness: list[int] = []
        self.busy_rows: list[int] = []

    def start(self, gid: int) -> None:
        """Start the next episode of ``episodes`` as a member of group ``gid``."""
        ep = next(self.episodes)
        self.live[self.next_id] = [ep, gid, self.version, ep.prompt]
        self.members[gid].append(self.next_id)
        self.ready.append((self.next_id, 0))
        self.next_id += 1

    def admit(self) -> None:
        """Start whole groups while in flight stays under the cap and started episodes under
        (version + k + 1) batches (no episode can then be more than k versions old when
        its batch is taken, unless it outlives later ones)."""
        g = self.g
        while len(self.live) + g <= self.cap and (self.groups + 1) * g <= (self.version + self.k + 1) * self.batch:
            self.group_left[self.groups] = g
            for _ in range(g):
                self.start(self.groups)
            self.groups += 1

    def drop_stale(self) -> None:
        """``drop``: restart every untrained episode whose oldest token is more than k behind."""
        live, slot = self.live, self.slot
        for eid in [e for e, x in live.items() if self.version - x[2] > self.k]:
            ep, gid, _, ctx = live.pop(eid)
            self.dropped += 1
            self.dropped_tokens += ctx - ep.prompt  # its generated tokens and observations so far
            for s, x in enumerate(slot):
                if x is not None and x[0] == eid:
                    slot[s] = None
            self.members[gid].remove(eid)
            if eid in self.finished:
                self.finished.discard(eid)
                self.group_left[gid] += 1
                if gid in self.ready_groups:
                    self.ready_groups.remove(gid)
            self.start(gid)
        kept = [x for x in self.ready if x[0] in live]
        self.ready.clear()
        self.ready.extend(kept)
        self.env[:] = [x for x in self.env if x[1] in live]
        heapq.heapify(self.env)

    def due_batch(self) -> list[int] | None:
        """``due``: the groups due soonest (started under version a: due by a + k) as far as
        later steps need, then the first to finish (ready_groups is in finish order)."""
        version, k = self.version, self.k
        q, done = self.batch // self.g, list(self.ready_groups)
        start_version = {gid: self.live[ids[0]][2] for gid, ids in self.members.items()}
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

    def take_batch(self) -> bool:
        """Train on the oldest ready groups if they make a batch (``step``: on the next step's
        groups once all are ready); their episodes leave."""
        batch, g, ready_groups = self.batch, self.g, self.ready_groups
        if self.sched.batches == "step":
            need = list(range(self.version * (batch // g), (self.version + 1) * (batch // g)))
            if not set(need) <= set(ready_groups):
                return False
            for gid in need:
                ready_groups.remove(gid)
        elif self.sched.batches == "due":
            need = self.due_batch()
            if need is None:
                return False
            for gid in need:
                ready_groups.remove(gid)
        elif len(ready_groups) * g < batch:
            return False
        else:
            need = [ready_groups.popleft() for _ in range(batch // g)]
        for gid in need:
            for eid in self.members.pop(gid):
                self.staleness.append(self.version - self.live.pop(eid)[2])
                self.finished.discard(eid)
        return True

    def bump(self, at: float) -> None:
        """A new policy version reaches the sampler at ``at``: the step ends there; drop what
        is now too stale (``drop``) and admit the groups the new version allows."""
        self.version += 1
        self.step_ends.append(at)
        if self.sched.stale == "drop" and self.k > 0:
            self.drop_stale()
        self.admit()

    def train_or_sync(self) -> bool:
        """The trainer's move at the current time; True when a new version was taken (the
        step ended), so the loop starts over. Split: the sampler takes finished weights, or
        the free trainer starts on a batch; colocated: a batch pauses decoding for the step
        and the reshard."""
        times = self.times
        if self.split:
            if self.new_weights is not None and self.t >= self.new_weights:  # the sampler takes the new weights
                self.t = self.new_weights + times.sync_s
                self.new_weights = None
                self.bump(self.t)
                return True
            if self.new_weights is None and self.t >= self.trainer_free and self.take_batch():
                self.trainer_free = self.new_weights = self.t + self.train_s
        elif self.take_batch():  # the same chips: decoding pauses for the step and the reshard
            self.t += self.train_s + times.sync_s
            self.compute_time += self.train_s - times.host_step_s + times.sync_s
            self.bump(self.t)
            return True
        return False

    def fill_slots(self) -> list[tuple]:
        """Queue the turns whose environments have answered, seat waiting turns in free
        slots, and return the occupied slots."""
        env, ready, slot = self.env, self.ready, self.slot
        while env and env[0][0] <= self.t:
            _, eid, turn = heapq.heappop(env)
            ready.append((eid, turn))
        for s in range(self.sched.slots):
            if slot[s] is None and ready:
                eid, turn = ready.popleft()
                slot[s] = (eid, turn, self.live[eid][0].turns[turn])
        return [x for x in slot if x is not None]

    def wait(self) -> None:
        """Nothing to decode: advance the clock to the next environment, trainer or new weights."""
        nxt = [self.env[0][0]] if self.env else []
        nxt += [self.new_weights] if self.new_weights is not None else []
        nxt += ([self.trainer_free] if self.split and self.trainer_free > self.t
                and len(self.ready_groups) * self.g >= self.batch else [])
        if not nxt:
            raise RuntimeError("the schedule stalled: in_flight holds less than one batch, or a bug")
        self.t = max(self.t, min(nxt))

    def decode_chunk(self, rows: list[tuple]) -> None:
        """Decode one chunk over ``rows`` (the occupied slots): turns that end go to their
        environment or finish their episode (and maybe their group); the clock advances."""
        sched, times, slot = self.sched, self.times, self.slot
        context = sum(self.live[x[0]][3] for x in rows)
        on_chips = sched.chunk * (times.decode_weights_s + context * times.decode_kv_s_per_token)
        dt = on_chips + times.host_chunk_s
        self.busy_rows.append(len(rows))
        self.decode_time += on_chips
        for s in range(sched.slots):
            if slot[s] is None:
                continue
            eid, turn, left = slot[s]
            x = self.live[eid]
            n = min(sched.chunk, left)
            x[3] += n
            if n < left:
                slot[s] = (eid, turn, left - n)
                continue
            slot[s] = None
            ep = x[0]
            if turn + 1 < len(ep.turns):
                x[3] += ep.obs[turn]
                heapq.heappush(self.env, (self.t + dt + times.env_s, eid, turn + 1))
            else:
                self.finished.add(eid)
                self.group_left[x[1]] -= 1
                if self.group_left[x[1]] == 0:
                    self.ready_groups.append(x[1])
        self.t += dt

    def run(self, steps: int) -> None:
        """Advance the schedule until ``steps`` steps have ended."""
        self.admit()
        while len(self.step_ends) < steps:
            if self.train_or_sync():
                continue
            rows = self.fill_slots()
            if not rows:
                self.wait()
                continue
            self.decode_chunk(rows)
            self.admit()

    def summary(self, steps: int, warmup_steps: int) -> dict:
        """The figures of :func:`simulate_rl` for a finished run of ``steps`` steps."""
        times = self.times
        ends = np.asarray(self.step_ends)
        w = min(warmup_steps, steps - 2)
        per_step = float(np.diff(ends[w:]).mean()) if steps > 1 else float(ends[-1])
        st = np.asarray(self.staleness[w * self.batch:] or [0])
        wall = float(ends[-1])
        if self.split:  # idle is what neither side does, weighted by its share of the chips
            share = self.share
            idle = share * (1 - self.decode_time / wall) + (1 - share) * (
                1 - min(1.0, steps * (self.train_s - times.host_step_s) / wall))
        else:
            idle = max(0.0, 1 - (self.compute_time + self.decode_time) / wall)
        busy_rows = self.busy_rows
        return {"seconds_per_step": per_step, "busy_rows": float(np.mean(busy_rows)) if busy_rows else 0.0,
                "chips_idle": idle, "staleness_mean": float(st.mean()),
                "staleness_p95": float(np.percentile(st, 95)), "staleness_max": int(st.max()),
                "dropped_per_step": self.dropped / steps, "dropped_tokens_per_step": self.dropped_tokens / steps,
                "steps": steps, "wall_s": wall}


def simulate_rl(episodes: Iterator[Episode], sched: RLSchedule, times: RLStepTimes, steps: int,
                warmup_steps: int = 2) -> dict:
    """Simulate ``steps`` RL steps of one host (hosts are alike); figures after ``warmup_steps``.

    Episodes come from ``episodes`` in order, ``group_size`` at a time (one task's group).
    Returns seconds per step, the sampler's busy rows per decode step, the share of wall
    time the chips compute nothing, staleness (versions, per trained episode: mean, p95,
    max) and the episodes and tokens dropped per step.
    """
    sim = _RLSimulation(episodes, sched, times)
    sim.run(steps)
    return sim.summary(steps, warmup_steps)


def steps_per_hour(result: dict) -> float:
    """RL steps per hour of a :func:`simulate_rl` result."""
    return 3600.0 / result["seconds_per_step"]
