"""The engine's host-side scheduler (docs/engine.md): everything :meth:`Engine.run
<lopd_jax.rollout.engine.Engine.run>` decides between device calls, without JAX.

A :class:`Scheduler` owns one run's slots, ready queue, page pool (:class:`~lopd_jax.rollout.
pages.Pages`), environment steps in flight, feed and weights. The engine's loop asks it, in
turn: :meth:`~Scheduler.poll` (environment results, timeouts, drops, the feed; False when the
run is over), :meth:`~Scheduler.admit` (ready episodes into free slots), a :class:`Prefill`
of the admitted ones (its pieces' rows out, their sampled tokens back, then
:meth:`~Scheduler.start_turns`), :meth:`~Scheduler.plan_decode` (pages for the next chunk,
preempting while the pool is full; the chunk's rows as a :class:`DecodePlan`),
:meth:`~Scheduler.take_decode` (the chunk's tokens appended, finished turns sent to their
environment) and, when nothing can run, :meth:`~Scheduler.unblock` (free pages or wait for an
environment step). Every device input is a numpy array and every result is taken as one, so
a test drives it with a fake device call (tests/rollout/test_scheduler.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from lopd_jax.core.shapes import bucket
from lopd_jax.rollout.engine_rows import DecodeRows, PrefillRows, embedding_overrides, page_table, row_keys
from lopd_jax.rollout.env_threads import EnvThreads, submit_inline
from lopd_jax.rollout.episode_spec import EpisodeFeed, EpisodeSpec, EpisodeState
from lopd_jax.rollout.pages import Pages

if TYPE_CHECKING:
    from lopd_jax.settings.sections import EngineConfig

__all__ = ["DecodePlan", "Prefill", "Scheduler", "check_episode", "row_count", "row_sizes", "stop_string_cut"]

ROW_SPLITS = 4  # device calls run slots, slots / 2, slots / 4 or slots / 8 rows (the fewest that hold the work)


def row_count(slots: int, n: int) -> int:
    """Rows of a device call that carries ``n`` occupied slots of ``slots``: the smallest of
    ``slots``, ``slots / 2``, ... (``ROW_SPLITS`` sizes, rounded up) that holds them, so a
    call computes no more than about twice the rows in use."""
    return min(r for r in {-(-slots // 2 ** k) for k in range(ROW_SPLITS)} if r >= n)


def row_sizes(slots: int) -> list[int]:
    """Every row count :func:`row_count` can return for ``slots``."""
    return sorted({row_count(slots, n) for n in range(1, slots + 1)})


def stop_string_cut(ids: Sequence[int], stop_strings: Sequence[str], decode: Callable[[list[int]], str]) -> int | None:
    """Smallest ``j`` such that ``decode(ids[:j])`` contains a stop string, or None (host-side)."""
    if not any(s in decode(list(ids)) for s in stop_strings):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(list(ids[:mid])) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def check_episode(i: int, e: EpisodeSpec, max_total: int) -> None:
    """Raise if episode ``i`` cannot run under a run's ``max_total`` (naming the fix)."""
    if not 0 < len(e.first) < e.max_total:
        raise ValueError(f"episode {i}: the first chunk has {len(e.first)} ids; it needs 1..max_total-1")
    if e.max_total > max_total:
        raise ValueError(f"episode {i}: max_total={e.max_total} is above the feed's max_total={max_total}")
    if e.embeds is not None and not 0 <= e.embeds[0] <= e.embeds[0] + len(e.embeds[1]) <= len(e.first):
        raise ValueError(f"episode {i}: its input embeddings cover positions {e.embeds[0]}.."
                         f"{e.embeds[0] + len(e.embeds[1]) - 1}, outside its first chunk of {len(e.first)}")


class Prefill:
    """The prefill of one admitted batch: every episode's un-cached ids in pieces of
    ``chunk`` tokens, one device call per piece for all of them (``rows`` rows).
    :meth:`next_piece` gives the next call's numpy :class:`~lopd_jax.rollout.engine_rows.
    PrefillRows`, :meth:`take` its sampled tokens; ``first`` then holds each episode's first
    token and both its log-probs."""

    def __init__(self, batch: Sequence[EpisodeState], rows: int, chunk: int, pad_id: int,
                 base_key: np.ndarray | None, m: collections.Counter):
        self.batch, self.rows, self.chunk, self.pad_id = list(batch), rows, chunk, pad_id
        self.base_key, self._m = base_key, m
        width = bucket(max(len(ep.pages) for ep in batch), (), 1)
        self.table = page_table(self.batch + [None] * (rows - len(batch)), width)
        self.pos = [ep.cached for ep in batch]
        self.first = (np.zeros(len(batch), np.int32), np.zeros(len(batch), np.float32),
                      np.zeros(len(batch), np.float32))
        self._n: np.ndarray | None = None

    def next_piece(self) -> PrefillRows | None:
        """The next call's rows, or None once every episode's context is fed."""
        if not any(p < len(ep.ctx) for p, ep in zip(self.pos, self.batch)):
            return None
        C, rows = self.chunk, self.rows
        ids = np.full((rows, C), self.pad_id, np.int32)
        start, n, eids = (np.zeros(rows, np.int32) for _ in range(3))
        for r, ep in enumerate(self.batch):
            piece = ep.ctx[self.pos[r]:self.pos[r] + C]
            ids[r, :len(piece)] = piece
            start[r], n[r], eids[r] = self.pos[r], len(piece), ep.eid
        vectors, use = embedding_overrides(self.batch, self.pos, C, rows)
        self._n = n
        return PrefillRows(ids, start, n, self.table, eids, vectors, use, row_keys(self.batch, rows, self.base_key))

    def take(self, tok: np.ndarray, lp: np.ndarray, raw: np.ndarray) -> None:
        """The last piece's sampled tokens and log-probs (numpy, one per row)."""
        n = self._n
        for r, ep in enumerate(self.batch):
            if n[r] and self.pos[r] + n[r] == len(ep.ctx):  # this episode's last piece: its first token
                self.first[0][r], self.first[1][r], self.first[2][r] = tok[r], lp[r], raw[r]
            self.pos[r] += int(n[r])
        self._m["prefill_calls"] += 1
        self._m["prefill_tokens"] += int(n.sum())


@dataclasses.dataclass
class DecodePlan:
    """One decode chunk: its episodes (None: padding rows), the slots they occupy, and the
    call's numpy :class:`~lopd_jax.rollout.engine_rows.DecodeRows`."""

    rows: list[EpisodeState | None]
    occupied: list[int]
    inputs: DecodeRows


class Scheduler:
    """One engine run's host state and decisions (the module docstring lists the calls).

    Args:
      config: the engine's :class:`~lopd_jax.settings.sections.EngineConfig`.
      episodes: the run's episodes (identity ``first_id + i`` unless a spec names its own).
      num_pages / max_total: the page pool's size and the longest episode it serves.
      params / version: the weights tokens are sampled with and their version (opaque here).
      local_params: turns a feed's new weights into :attr:`params` (the engine's layout).
      stop_ids / stop_strings / decode / pad_id: what ends a turn and pads a row.
      feed / on_finish: as :meth:`Engine.run` takes them.
      base_key: the run key's data when rows carry keys (else None).
      pool: the engine's environment threads (None: steps run inline, never timed out).
    """

    def __init__(self, config: "EngineConfig", episodes: Sequence[EpisodeSpec], *, num_pages: int, max_total: int,
                 params: Any = None, version: int = 0, local_params: Callable[[Any], Any] = lambda p: p,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None, pad_id: int = 0, first_id: int = 0,
                 feed: EpisodeFeed | None = None, on_finish: Callable[[int], None] | None = None,
                 base_key: np.ndarray | None = None, pool: EnvThreads | None = None):
        self.cfg, self.K = config, config.decode_chunk
        self.params, self.version, self.local_params = params, int(version), local_params
        self.stop_ids, self.stop_strings = tuple(stop_ids), tuple(stop_strings)
        self.decode, self.pad_id = decode, pad_id
        self.feed, self.on_finish, self.base_key, self.pool = feed, on_finish, base_key, pool
        self.max_total, self.num_pages = max_total, num_pages
        self.pages = Pages(num_pages, config.page_size)
        self.eps = [EpisodeState(spec, first_id + i if spec.identity is None else int(spec.identity),
                                 [int(x) for x in spec.first]) for i, spec in enumerate(episodes)]
        self.ready = collections.deque(self.eps)
        self.slots: list[EpisodeState | None] = [None] * config.slots
        self.prev = np.zeros(config.slots, np.int32)  # each slot's last sampled token
        self.futures: dict[concurrent.futures.Future, EpisodeState] = {}
        self.m = collections.Counter()
        self.admitted = 0  # admissions so far (an episode's ``admitted`` is its latest)
        self.in_flight = 0  # episodes started (admitted once) and not finished
        self.limit = config.max_in_flight or (len(self.eps) if feed is None else 2 * config.slots)
        self.fed, self.feed_over = len(self.eps), feed is None  # episodes given so far
        self.timeout = config.env_timeout_s if pool is not None else 0.0  # an inline step cannot be timed out
        self.env_wait_s = 0.0  # time blocked waiting for environment steps

    def busy(self) -> bool:
        """Whether any episode waits, decodes or steps."""
        return bool(self.ready or self.futures or any(s is not None for s in self.slots))

    def _may_start(self, ep: EpisodeState) -> bool:
        return bool(ep.admitted) or self.in_flight < self.limit

    # ----- the loop's calls -----
    def poll(self) -> bool:
        """Start of an iteration: the feed's cancel and drops, finished and timed-out
        environment steps, more episodes from the feed. False when the run is over."""
        feed = self.feed
        if not self.busy() and self.feed_over:
            return False
        if feed is not None and feed.cancelled:  # dropped unfinished: their pages go back
            held = [*self.ready, *self.futures.values(), *(e for e in self.slots if e is not None)]
            self.m["cancelled_episodes"] = len(held)
            for ep in held:
                self.pages.release(ep)
            return False
        if feed is not None:
            self.drop(feed.take_drops())
        if self.futures and None in self.slots:
            time.sleep(0)  # yield the GIL: steps just submitted (fast environments) can land before admission
        done = [f for f in self.futures if f.done()]
        ended = sum(self._finish_env(fut, self.futures.pop(fut)) for fut in done)
        if self.timeout and self.futures:
            late = [f for f, e in self.futures.items()
                    if time.monotonic() - e.submitted > self.timeout and not f.done()]
            ended += sum(self._time_out(fut, self.futures.pop(fut)) for fut in late)
        self.in_flight -= ended
        if ended and self.on_finish is not None:
            self.on_finish(ended)
        if not self.feed_over and self.in_flight < self.limit and all(e.admitted for e in self.ready):
            self.take_feed()
            if self.feed_over and not self.busy():
                return False
        return True

    def admit(self) -> list[EpisodeState]:
        """Ready episodes into free slots, in queue order (the admitted batch, to prefill).
        One that cannot get pages waits without blocking those behind it; a new episode
        also waits for room under the in-flight limit; an idle engine serves the oldest
        first, preempting newer ready episodes for its pages."""
        K, ready, slots, pages = self.K, self.ready, self.slots, self.pages
        batch, skipped = [], set()
        if ready and all(s is None for s in slots):  # idle: the oldest ready episode first
            head = next((e for e in ready if self._may_start(e)), None)
            while head is not None and not pages.grow(head, len(head.ctx) + min(K, head.cap)):
                holders = [e for e in ready if e.pages and e is not head]
                if not holders:
                    break
                self.preempt(max(holders, key=lambda e: e.admitted))
        while ready and None in slots:
            j = next((j for j, e in enumerate(ready) if id(e) not in skipped and self._may_start(e)), None)
            if j is None:
                break
            ep = ready[j]
            if not pages.grow(ep, len(ep.ctx) + min(K, ep.cap)):
                self.m["admission_waits"] += not skipped
                skipped.add(id(ep))
                continue
            del ready[j]
            self.in_flight += ep.admitted == 0
            ep.slot = slots.index(None)
            slots[ep.slot] = ep
            self.admitted += 1
            if ep.admitted:  # a started episode back from its environment (or preempted)
                self.m["max_ready_wait_s"] = max(self.m["max_ready_wait_s"], time.monotonic() - ep.ready_since)
            ep.admitted = self.admitted
            batch.append(ep)
        return batch

    def prefill(self, batch: Sequence[EpisodeState]) -> Prefill:
        """The prefill of an admitted ``batch`` (:class:`Prefill`, in :func:`row_count` rows)."""
        return Prefill(batch, row_count(self.cfg.slots, len(batch)), self.cfg.prefill_chunk, self.pad_id,
                       self.base_key, self.m)

    def start_turns(self, prefill: Prefill) -> None:
        """Each prefilled episode's first token starts its turn (which may end at once)."""
        tok, lp, raw = prefill.first
        for r, ep in enumerate(prefill.batch):
            ep.cached = len(ep.ctx)
            ep.turn, ep.lps, ep.raws = [int(tok[r])], [float(lp[r])], [float(raw[r])]
            ep.vers = [self.version]
            self.m["useful_tokens"] += 1
            self.prev[ep.slot] = tok[r]
            if self._turn_over(ep):
                self.end_turn(ep)

    def plan_decode(self) -> DecodePlan | None:
        """Pages for the next chunk (preempting the newest running episode while the pool is
        full) and the chunk's rows: the occupied slots only, in :func:`row_count` rows. None
        when no slot is occupied."""
        K, slots = self.K, self.slots
        for ep in sorted((ep for ep in slots if ep is not None), key=lambda e: e.admitted):
            while ep.slot is not None and not self.pages.grow(ep, ep.cached + min(K, ep.cap - len(ep.turn))):
                self.preempt(max((e for e in slots if e is not None), key=lambda e: e.admitted))
        occupied = [s for s, ep in enumerate(slots) if ep is not None]
        if not occupied:
            return None
        R = row_count(self.cfg.slots, len(occupied))
        rows = [slots[s] for s in occupied] + [None] * (R - len(occupied))
        width = bucket(max(len(slots[s].pages) for s in occupied), (), 1)
        live = np.asarray([ep is not None for ep in rows])
        lengths = np.asarray([0 if ep is None else ep.cached for ep in rows], np.int32)
        remaining = np.asarray([0 if ep is None else ep.cap - len(ep.turn) for ep in rows], np.int32)
        eids = np.asarray([0 if ep is None else ep.eid for ep in rows], np.int32)
        prev = np.zeros(R, np.int32)
        prev[:len(occupied)] = self.prev[occupied]
        inputs = DecodeRows(prev, lengths, live, remaining, page_table(rows, width), eids,
                            row_keys(rows, R, self.base_key))
        return DecodePlan(rows, occupied, inputs)

    def take_decode(self, plan: DecodePlan, toks: np.ndarray, lps: np.ndarray, raws: np.ndarray,
                    n_gen: np.ndarray) -> None:
        """A chunk's results (numpy ``[rows, K]`` tokens and log-probs, ``n_gen`` [rows]
        generated per row): appended to each turn; finished turns go to their environment."""
        K, m = self.K, self.m
        m["decode_calls"] += 1
        m["slot_steps"] += self.cfg.slots * K
        m["row_steps"] += len(plan.rows) * K
        for r, s in enumerate(plan.occupied):
            ep = plan.rows[r]
            g = int(n_gen[r])
            ep.turn += toks[r, :g].tolist()
            ep.lps += lps[r, :g].tolist()
            ep.raws += raws[r, :g].tolist()
            ep.vers += [self.version] * g
            ep.cached += g
            m["useful_tokens"] += g
            m["useful_slot_steps"] += g
            if g:
                self.prev[s] = toks[r, g - 1]
            if self._turn_over(ep):
                self.end_turn(ep)

    def unblock(self) -> None:
        """Nothing runs: free pages for the first ready episode (the newest other ready
        holder's, else the longest-running environment step's), or wait for a step."""
        head = next((e for e in self.ready if self._may_start(e)), None)
        holders = [e for e in self.ready if e.pages and e is not head]
        stepping = [e for e in self.futures.values() if e.pages]
        if head is None:
            if self.futures:
                self.wait_for_steps()
        elif holders:  # pages other ready episodes hold: recompute the newest
            self.preempt(max(holders, key=lambda e: e.admitted))
        elif stepping:  # pages episodes in an environment step hold: the longest-running one's
            self.preempt(min(stepping, key=lambda e: e.submitted))
        elif self.futures:
            self.wait_for_steps()
        else:
            raise RuntimeError("the page pool cannot hold the next episode")  # unreachable: checked

    def finish(self) -> dict:
        """The run's metrics, once the loop is over."""
        m = self.m
        m["peak_pages"] = self.pages.peak
        m["num_pages"] = self.num_pages
        m["leaked_pages"] = self.num_pages - len(self.pages.free)  # 0: every ended episode gave its pages back
        m["utilisation"] = m["useful_slot_steps"] / max(m["slot_steps"], 1)
        return dict(m)

    # ----- turns and episodes -----
    def _cut_at_stop_string(self, ep: EpisodeState) -> bool:
        """Cut ``ep``'s running turn after the first stop string (rewinding its cache);
        True if it had one."""
        if not self.stop_strings or not ep.turn:
            return False
        cut = stop_string_cut(ep.turn, self.stop_strings, self.decode)
        if cut is None:
            return False
        ep.turn, ep.lps, ep.raws, ep.vers = ep.turn[:cut], ep.lps[:cut], ep.raws[:cut], ep.vers[:cut]
        ep.cached = min(ep.cached, len(ep.ctx) + cut - 1)  # a turn's last id is never cached
        return True

    def _turn_over(self, ep: EpisodeState) -> bool:
        return self._cut_at_stop_string(ep) or ep.turn[-1] in self.stop_ids or len(ep.turn) >= ep.cap

    def end_turn(self, ep: EpisodeState) -> None:
        """``ep``'s turn is over: it leaves its slot (keeping its pages) and its environment
        step is submitted."""
        self.slots[ep.slot] = None
        ep.slot = None
        ids = np.asarray(ep.turn, np.int32)
        lps, raws = np.asarray(ep.lps, np.float32), np.asarray(ep.raws, np.float32)
        ep.result.turns.append(ids)
        ep.result.logprobs.append(lps)
        ep.result.raw_logprobs.append(raws)
        ep.result.versions.append(np.asarray(ep.vers, np.int32))
        ep.ctx.extend(ep.turn)
        ep.turn, ep.lps, ep.raws, ep.vers = [], [], [], []
        ep.submitted = time.monotonic()
        step = ep.spec.step
        self.futures[self.pool.submit(step, ids, lps, raws) if self.pool else submit_inline(step, ids, lps, raws)] = ep

    def _end_episode(self, ep: EpisodeState, error: str | None = None) -> bool:
        if error is not None:
            ep.result.error = error
            self.m["env_errors"] += 1
        self.pages.release(ep)
        ep.result.context = list(ep.ctx)
        if self.feed is not None:
            self.feed.ended(ep.spec, ep.result)
        return True

    def _finish_env(self, fut: concurrent.futures.Future, ep: EpisodeState) -> bool:
        """Take an environment step's result; True when the episode ended. A step that
        raised or returned something other than ids below the cap ends its own episode."""
        try:
            obs = fut.result()
            if obs is None:
                return self._end_episode(ep)
            obs = [int(x) for x in obs]
        except Exception as exc:  # a crashing environment ends its own episode only
            return self._end_episode(ep, repr(exc))
        if len(ep.ctx) + len(obs) >= ep.spec.max_total:
            return self._end_episode(ep, f"observation: {len(obs)} ids leave no room below max_total="
                                         f"{ep.spec.max_total}; the step function must end the episode instead")
        ep.ctx.extend(obs)
        ep.ready_since = time.monotonic()
        self.ready.append(ep)
        return False

    def _time_out(self, fut: concurrent.futures.Future, ep: EpisodeState) -> bool:
        """Give up on a step past ``env_timeout_s``: its episode ends, its thread is abandoned."""
        self.pool.abandon(fut)
        self.m["env_timeouts"] += 1
        if ep.spec.abandon is not None:
            ep.spec.abandon()
        return self._end_episode(ep, f"timeout: the environment step ran past engine.env_timeout_s="
                                     f"{self.timeout:g}s")

    def wait_for_steps(self) -> None:
        """Block until a step lands or the next step deadline passes."""
        now = time.monotonic()
        wait = max(0.0, min(e.submitted for e in self.futures.values()) + self.timeout - now) if self.timeout else None
        concurrent.futures.wait(list(self.futures), timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)
        waited = time.monotonic() - now
        self.env_wait_s += waited
        if self.ready:  # ready work sat idle behind environment steps this long
            self.m["max_idle_wait_s"] = max(self.m["max_idle_wait_s"], waited)

    def preempt(self, ep: EpisodeState) -> None:
        """Free ``ep``'s pages; it is recomputed from its whole context when admitted
        again (a running episode goes back to the head of the queue)."""
        self.m["preemptions"] += 1
        self.m["recomputed_tokens"] += ep.cached + len(ep.turn)
        if ep.slot is not None:
            self.slots[ep.slot] = None
            ep.slot = None
            ep.ready_since = time.monotonic()
            self.ready.appendleft(ep)
        ep.turn, ep.lps, ep.raws, ep.vers = [], [], [], []
        self.pages.release(ep)

    # ----- the feed -----
    def drop(self, specs: Sequence[EpisodeSpec]) -> None:
        """Drop the feed's episodes ``specs`` wherever they are (their pages go back; a
        running environment step is abandoned). They end without a result."""
        ids = {id(x) for x in specs}  # episodes that ended meanwhile are no longer held
        if not ids:
            return

        def forget(ep: EpisodeState, admitted: bool = True) -> None:
            self.in_flight -= admitted
            self.pages.release(ep)
            self.m["dropped_episodes"] += 1

        for ep in [e for e in self.ready if id(e.spec) in ids]:  # waiting for a slot
            self.ready.remove(ep)
            forget(ep, ep.admitted > 0)
        for j, ep in enumerate(self.slots):  # decoding
            if ep is not None and id(ep.spec) in ids:
                self.slots[j], ep.slot = None, None
                forget(ep)
        for fut, ep in [(f, e) for f, e in self.futures.items() if id(e.spec) in ids]:  # in an environment step
            self.futures.pop(fut)
            if self.pool is not None:
                self.pool.abandon(fut)
            if ep.spec.abandon is not None:
                ep.spec.abandon()
            forget(ep)

    def swap_weights(self, params: Any, version: int) -> None:
        """New weights (converted by ``local_params``): every episode in flight goes on
        under them; tokens sampled from now on record ``version``."""
        self.params, self.version = self.local_params(params), int(version)
        self.m["weight_swaps"] += 1

    def take_feed(self) -> None:
        """Ask the feed for more work (every episode given has started and there is room)."""
        idle = not self.busy()
        item = self.feed.more(idle)
        if item is None:
            self.feed_over = True
            return
        if item.params is not None:
            self.swap_weights(item.params, item.version)
        for spec in item.episodes:
            check_episode(self.fed, spec, self.max_total)
            self.ready.append(EpisodeState(spec, self.fed if spec.identity is None else int(spec.identity),
                                           [int(x) for x in spec.first]))
            self.fed += 1
        if idle and not item.episodes:
            raise RuntimeError("the episode feed gave an idle engine nothing and did not end; a feed must "
                               "block until it has work (EpisodeFeed.more)")
