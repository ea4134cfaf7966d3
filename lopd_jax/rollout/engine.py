"""A rollout engine with continuous batching over a paged KV cache (docs/engine.md).

Each episode cycles: ready -> a decode slot (one turn, in chunks of ``decode_chunk`` steps
for every slot at once) -> its environment step on a thread -> ready (observation) -> ... ->
done. An episode owns KV pages (one pool per layer) from admission to its end, also while
its environment runs. Admission takes ready episodes in queue order; one that cannot get
pages waits without blocking those behind it; an idle engine serves the oldest first,
preempting newer ready episodes for its pages, so none starves. A running row that cannot grow preempts the newest running episode; an idle engine frees
pages of waiting episodes (the newest ready one, else the one whose environment step has run
longest) rather than wait on a step. Preempted episodes are recomputed from their context. A step runs
at most ``env_timeout_s``: then its episode ends with an error and its thread is abandoned.
Determinism: token ``p`` of episode ``e`` is sampled with ``fold_in(fold_in(rng, e), p)``
(``rng``: the run's key or the episode's own), whatever the slots, pool, other episodes or
timing. A run may also take more episodes and new weights as it goes from an
:class:`~lopd_jax.rollout.episode_spec.EpisodeFeed` (partial rollouts across training steps:
episodes in flight go on under the new weights; each token records its weights' version). Optional: host-side stop strings (the
cache rewound to the cut), input-embedding overrides (composer latents). Process-local: each
process decodes its own episodes on its own ``data x tensor`` mesh (:mod:`.layout`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.core.shapes import bucket
from lopd_jax.settings.sections import EngineConfig, SamplingParams
from models.decoder import Decoder
from lopd_jax.rollout import engine_calls
from lopd_jax.rollout import layout as inference_layout
from lopd_jax.rollout.env_threads import EnvThreads, submit_inline
from lopd_jax.rollout.episode_spec import EpisodeFeed, EpisodeResult, EpisodeSpec, EpisodeState
from lopd_jax.rollout.engine_rows import embedding_overrides, page_table, row_keys
from lopd_jax.rollout.pages import Pages, key_data
from lopd_jax.rollout.paged_step import empty_pools
from lopd_jax.rollout.sampling import stop_string_cut

__all__ = ["Engine"]

ROW_SPLITS = 4  # device calls run slots, slots / 2, slots / 4 or slots / 8 rows (the fewest that hold the work)


def _single_device_graphdef(model: nnx.Module):
    """``model``'s graph without the training mesh's sharding rules (a test policy's).

    A test policy runs on one device per process, so sharding constraints written for the
    trainer's mesh (a :class:`models.decoder.Decoder`'s ``rules``, applied e.g. to the input
    embeddings that composer latents replace) would ask for devices its arrays are not on.
    The clone shares the model's arrays; the model itself is unchanged.
    """
    graphdef, state = nnx.split(model)
    if getattr(model, "rules", None) is None:
        return graphdef
    clone = nnx.merge(graphdef, state)
    clone.rules = None
    return nnx.split(clone)[0]


class Engine:
    """Continuous-batching rollout engine over a paged KV cache (see the module docstring).

    Args:
      model: a :class:`models.decoder.Decoder` (only its config is kept; parameters are
        passed to :meth:`run`; the engine decodes on its own layout, ``config``'s
        ``devices`` / ``tensor`` / ``dtype``), or a module with ``cfg``, ``embed_tokens``,
        ``lm_head_kernel`` and its own ``paged_forward`` (a test policy: one device, its
        parameters as given).
      stop_ids: end-of-turn ids.
      config: :class:`EngineConfig`.
      sampling: default :class:`SamplingParams`.
      lora: run with the LoRA adapters on (folded into the weights).
      pad_id: id used for padding.
      stop_strings / decode: optional host-side stop strings and the ``ids -> text``
        function that finds them (e.g. a tokenizer's ``decode``).
      devices: the process's devices (default ``jax.local_devices()``; an AOT compile
        passes one host's devices of a TPU topology).
    """

    def __init__(self, model: nnx.Module, *, stop_ids: Sequence[int], config: EngineConfig = EngineConfig(),
                 sampling: SamplingParams = SamplingParams(), lora: bool = False, pad_id: int = 0,
                 stop_strings: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                 devices: Sequence | None = None):
        if stop_strings and decode is None:
            raise ValueError("stop_strings need a decode function (ids -> text), e.g. tokenizer.decode")
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.config = config
        self.sampling = sampling
        if isinstance(model, Decoder):  # the inference layout: LoRA merged, no adapters at run time
            devices, tensor = inference_layout.engine_devices(model.cfg, config.devices, config.tensor, devices)
            self.mesh = inference_layout.inference_mesh(devices, tensor)
            self.train_cfg = model.cfg if lora else model.cfg.replace(lora=None)
            self.graphdef, _, self.shardings = inference_layout.inference_shardings(model.cfg, self.mesh, config.dtype)
            self.cfg = inference_layout.inference_model_config(model.cfg, config.dtype)
            self.lora = False
        else:
            self.mesh = self.shardings = self.train_cfg = None
            self.graphdef = _single_device_graphdef(model)
            self.cfg = model.cfg
            self.lora = lora
        self.pad_id = int(pad_id)
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        self.metrics: dict[str, float] = {}
        self._pool_makers: dict[int, Callable] = {}

    @staticmethod
    def params_of(model: nnx.Module) -> dict:
        """The model's parameter state as a pure dict (what :meth:`run` takes as ``params``)."""
        return nnx.to_pure_dict(nnx.split(model)[1])

    def local_params(self, params) -> dict:
        """The policy's parameters (:meth:`params_of`'s dict, e.g. FSDP-sharded training
        weights with their LoRA factors) as the engine runs them, on this process's devices:
        merged, cast and laid out on :attr:`mesh`
        (:func:`lopd_jax.rollout.layout.local_params`; a test policy's as given, on the first
        device). Parameters spanning processes take one collective, which every process must
        call together. Params already in the engine's layout are returned as they are.
        """
        if self.mesh is None:
            return jax.device_put(inference_layout.replicated_locally(params), jax.local_devices()[0])
        if inference_layout.laid_out(params, self.shardings, self.cfg.jnp_dtype):
            return params
        return inference_layout.local_params(params, self.train_cfg, self.mesh, self.shardings, self.config.dtype)

    def local_key(self, rng: jax.Array) -> jax.Array:
        """A PRNG key (the same on every process) on this process's engine devices."""
        rng = inference_layout.replicated_locally(rng)
        if self.mesh is None:
            return jax.device_put(rng, jax.local_devices()[0])
        return jax.device_put(rng, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _empty_pools(self, num_pages: int):
        """Zero page pools for ``num_pages`` pages, made in place on the engine's layout."""
        if self.mesh is None:
            return empty_pools(self.cfg, num_pages, self.config.page_size)
        make = self._pool_makers.get(num_pages)
        if make is None:  # one jitted maker per pool size: a fresh lambda would compile on every run
            sh = inference_layout.pool_sharding(self.mesh)
            make = self._pool_makers[num_pages] = jax.jit(
                lambda: empty_pools(self.cfg, num_pages, self.config.page_size),
                out_shardings=(sh,) * self.cfg.num_layers)
        return make()

    # ----- page pool -----
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.config.page_size)

    def _rows(self, n: int) -> int:
        """Rows of a device call that carries ``n`` occupied slots: the smallest of
        ``slots``, ``slots / 2``, ... (``ROW_SPLITS`` sizes, rounded up) that holds them, so
        a call computes no more than about twice the rows in use."""
        S = self.config.slots
        return min(r for r in {-(-S // 2 ** k) for k in range(ROW_SPLITS)} if r >= n)

    def _row_sizes(self) -> list[int]:
        """Every row count :meth:`_rows` can return."""
        return sorted({self._rows(n) for n in range(1, self.config.slots + 1)})

    @property
    def program(self) -> engine_calls.Program:
        """The static part of every device call (:class:`lopd_jax.rollout.engine_calls.Program`)."""
        return engine_calls.Program(self.graphdef, self.lora, self.mesh, self.stop_ids, self.config.decode_chunk)

    @staticmethod
    def _device_sampling(sp: SamplingParams) -> SamplingParams:
        """``sp`` with float32 scalar leaves, as every device call takes it (one compiled variant)."""
        return jax.tree.map(jnp.float32, sp)

    def _prefill_batch(self, batch: Sequence[EpisodeState], params, pools, rng, sampling: SamplingParams, m,
                       base_key: np.ndarray | None = None):
        """Feed every admitted episode's un-cached ids in pieces of ``prefill_chunk`` tokens
        (one call per piece for all of them, :meth:`_rows` rows); return each one's first
        sampled token, both log-probs, and the pools."""
        cfg = self.config
        C, rows = cfg.prefill_chunk, self._rows(len(batch))
        width = bucket(max(len(ep.pages) for ep in batch), (), 1)
        table = page_table(list(batch) + [None] * (rows - len(batch)), width)
        pos = [ep.cached for ep in batch]
        out = [np.zeros(len(batch), np.int32), np.zeros(len(batch), np.float32), np.zeros(len(batch), np.float32)]
        while any(p < len(ep.ctx) for p, ep in zip(pos, batch)):
            ids = np.full((rows, C), self.pad_id, np.int32)
            start, n, eids = (np.zeros(rows, np.int32) for _ in range(3))
            for r, ep in enumerate(batch):
                piece = ep.ctx[pos[r]:pos[r] + C]
                ids[r, :len(piece)] = piece
                start[r], n[r], eids[r] = pos[r], len(piece), ep.eid
            vectors, use = embedding_overrides(batch, pos, C, rows)
            rows_in = engine_calls.PrefillRows(ids, start, n, table, eids, vectors, use,
                                               row_keys(batch, rows, base_key))
            (tok, lp, raw), pools = engine_calls.prefill(self.program.model_part(), params, pools, rows_in, sampling,
                                                         rng)
            tok, lp, raw = np.asarray(tok), np.asarray(lp), np.asarray(raw)
            for r, ep in enumerate(batch):
                if n[r] and pos[r] + n[r] == len(ep.ctx):  # this episode's last piece: its first token
                    out[0][r], out[1][r], out[2][r] = tok[r], lp[r], raw[r]
                pos[r] += int(n[r])
            m["prefill_calls"] += 1
            m["prefill_tokens"] += int(n.sum())
        return (*out, pools)

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

    def precompile(self, params, max_total: int, sampling: SamplingParams | None = None) -> int:
        """Compile (by running once on a scratch pool) every prefill and decode variant a run
        with episodes of up to ``max_total`` tokens can meet: one per power-of-two count of
        pages read and row count (:meth:`_rows`). Returns the number of variants."""
        sp = self._device_sampling(sampling or self.sampling)
        cfg, n = self.config, 0
        row_pages = self._pages_for(max_total)
        params = self.local_params(params)
        pools = self._empty_pools(cfg.num_pages or cfg.slots * row_pages)
        C = cfg.prefill_chunk
        key = self.local_key(jax.random.key(0))  # placed as run places its key (same compiled variant)
        w = 1
        while True:
            for S in self._row_sizes():
                z, table = np.zeros(S, np.int32), np.zeros((S, w), np.int32)
                rows = engine_calls.PrefillRows(np.zeros((S, C), np.int32), z, z, table, z)
                _, pools = engine_calls.prefill(self.program.model_part(), params, pools, rows, sp, key)  # as run
                rows = engine_calls.DecodeRows(z, z, np.zeros(S, bool), z, table, z)
                _, pools = engine_calls.decode(self.program, params, pools, rows, sp, key)
                n += 2
            if w >= row_pages:
                return n
            w *= 2

    # ----- the loop -----
    @staticmethod
    def _check(i: int, e: EpisodeSpec, max_total: int) -> None:
        if not 0 < len(e.first) < e.max_total:
            raise ValueError(f"episode {i}: the first chunk has {len(e.first)} ids; it needs 1..max_total-1")
        if e.max_total > max_total:
            raise ValueError(f"episode {i}: max_total={e.max_total} is above the feed's max_total={max_total}")
        if e.embeds is not None and not 0 <= e.embeds[0] <= e.embeds[0] + len(e.embeds[1]) <= len(e.first):
            raise ValueError(f"episode {i}: its input embeddings cover positions {e.embeds[0]}.."
                             f"{e.embeds[0] + len(e.embeds[1]) - 1}, outside its first chunk of {len(e.first)}")

    def run(self, params, episodes: Sequence[EpisodeSpec], rng: jax.Array, sampling: SamplingParams | None = None,
            *, first_id: int = 0, on_finish: Callable[[int], None] | None = None,
            feed: EpisodeFeed | None = None, version: int = 0) -> list[EpisodeResult]:
        """Run every episode to its end; results in input order. Metrics of the run are in
        :attr:`metrics`.

        ``params``: :meth:`local_params`' result (or parameters it converts on each call).
        Episode ``i`` is identity ``first_id + i``: its tokens are sampled with
        ``fold_in(rng, first_id + i)`` (then the position), so a batch split differently
        (over calls or processes) samples the same tokens. ``on_finish(n)`` is called (on
        this thread) whenever ``n`` episodes have just ended. ``feed``: more episodes and
        new weights as the run goes (:class:`~lopd_jax.rollout.episode_spec.EpisodeFeed`;
        their results go to ``feed.ended``, not into the returned list); the in-flight
        limit is then ``max_in_flight`` or twice the slots. ``version``: the version of
        ``params`` that tokens record until the feed gives new weights.
        """
        sp = self._device_sampling(sampling or self.sampling)
        cfg = self.config
        K, ps = cfg.decode_chunk, cfg.page_size
        if not episodes and feed is None:
            return []
        max_total = max([e.max_total for e in episodes] + ([feed.max_total] if feed is not None else []))
        row_pages = self._pages_for(max_total)
        num_pages = cfg.num_pages or cfg.slots * row_pages
        if num_pages < row_pages:
            raise ValueError(f"EngineConfig.num_pages={num_pages} cannot hold one episode of "
                             f"{max_total} tokens ({row_pages} pages of {ps}); raise it")
        for i, e in enumerate(episodes):
            self._check(i, e, max_total)
        params, rng = self.local_params(params), self.local_key(rng)
        base_key = key_data(rng) if feed is not None or any(e.rng is not None for e in episodes) else None
        pools = self._empty_pools(num_pages)
        pages = Pages(num_pages, ps)
        eps = [EpisodeState(spec, first_id + i if spec.identity is None else int(spec.identity), [int(x) for x in spec.first])
               for i, spec in enumerate(episodes)]
        ready = collections.deque(eps)
        slots: list[EpisodeState | None] = [None] * cfg.slots
        prev = np.zeros(cfg.slots, np.int32)
        futures: dict[concurrent.futures.Future, EpisodeState] = {}
        m = collections.Counter()
        admitted = 0
        in_flight = 0  # episodes started (admitted once) and not finished
        limit = cfg.max_in_flight or (len(eps) if feed is None else 2 * cfg.slots)
        fed, feed_over = len(eps), feed is None  # episodes given so far
        t0 = time.perf_counter()
        pool = EnvThreads(cfg.env_workers) if cfg.env_workers else None
        timeout = cfg.env_timeout_s if pool is not None else 0.0  # a step on this thread cannot be timed out

        def end_turn(ep: EpisodeState):
            slots[ep.slot] = None
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
            futures[pool.submit(ep.spec.step, ids, lps, raws) if pool else submit_inline(ep.spec.step, ids, lps, raws)] = ep

        def end_episode(ep: EpisodeState, error: str | None = None) -> bool:
            if error is not None:
                ep.result.error = error
                m["env_errors"] += 1
            pages.release(ep)
            ep.result.context = list(ep.ctx)
            if feed is not None:
                feed.ended(ep.spec, ep.result)
            return True

        def finish_env(fut, ep: EpisodeState) -> bool:
            """Take an environment step's result; True when the episode ended. A step that
            raised or returned something other than ids below the cap ends its own episode."""
            try:
                obs = fut.result()
                if obs is None:
                    return end_episode(ep)
                obs = [int(x) for x in obs]
            except Exception as exc:  # a crashing environment ends its own episode only
                return end_episode(ep, repr(exc))
            if len(ep.ctx) + len(obs) >= ep.spec.max_total:
                return end_episode(ep, f"observation: {len(obs)} ids leave no room below max_total="
                                       f"{ep.spec.max_total}; the step function must end the episode instead")
            ep.ctx.extend(obs)
            ep.ready_since = time.monotonic()
            ready.append(ep)
            return False

        def time_out(fut, ep: EpisodeState) -> bool:
            """Give up on a step past ``env_timeout_s``: its episode ends, its thread is abandoned."""
            pool.abandon(fut)
            m["env_timeouts"] += 1
            if ep.spec.abandon is not None:
                ep.spec.abandon()
            return end_episode(ep, f"timeout: the environment step ran past engine.env_timeout_s={timeout:g}s")

        def wait_for_steps() -> None:
            """Block until a step lands or the next step deadline passes."""
            now = time.monotonic()
            limit = max(0.0, min(e.submitted for e in futures.values()) + timeout - now) if timeout else None
            concurrent.futures.wait(list(futures), timeout=limit, return_when=concurrent.futures.FIRST_COMPLETED)
            if ready:  # ready work sat idle behind environment steps this long
                m["max_idle_wait_s"] = max(m["max_idle_wait_s"], time.monotonic() - now)

        def preempt(ep: EpisodeState):
            """Free ``ep``'s pages; it is recomputed from its whole context when admitted
            again (a running episode goes back to the head of the queue)."""
            m["preemptions"] += 1
            m["recomputed_tokens"] += ep.cached + len(ep.turn)
            if ep.slot is not None:
                slots[ep.slot] = None
                ep.slot = None
                ep.ready_since = time.monotonic()
                ready.appendleft(ep)
            ep.turn, ep.lps, ep.raws, ep.vers = [], [], [], []
            pages.release(ep)

        def turn_over(ep: EpisodeState) -> bool:
            return self._cut_at_stop_string(ep) or ep.turn[-1] in self.stop_ids or len(ep.turn) >= ep.cap

        def drop_specs(specs) -> None:
            """Drop the feed's episodes ``specs`` wherever they are (their pages go back; a
            running environment step is abandoned). They end without a result."""
            ids = {id(x) for x in specs}  # episodes that ended meanwhile are no longer held
            if not ids:
                return

            def forget(ep, admitted: bool = True) -> None:
                nonlocal in_flight
                in_flight -= admitted
                pages.release(ep)
                m["dropped_episodes"] += 1

            for ep in [e for e in ready if id(e.spec) in ids]:  # waiting for a slot
                ready.remove(ep)
                forget(ep, ep.admitted > 0)
            for j, ep in enumerate(slots):  # decoding
                if ep is not None and id(ep.spec) in ids:
                    slots[j], ep.slot = None, None
                    forget(ep)
            for fut, ep in [(f, e) for f, e in futures.items() if id(e.spec) in ids]:  # in an environment step
                futures.pop(fut)
                if pool is not None:
                    pool.abandon(fut)
                if ep.spec.abandon is not None:
                    ep.spec.abandon()
                forget(ep)

        def take_feed() -> None:
            """Ask the feed for more work when every episode given has started and there is room."""
            nonlocal params, version, fed, feed_over
            idle = not ready and not futures and all(s is None for s in slots)
            item = feed.more(idle)
            if item is None:
                feed_over = True
                return
            if item.params is not None:  # new weights: every episode in flight goes on under them
                params, version = self.local_params(item.params), int(item.version)
                m["weight_swaps"] += 1
            for spec in item.episodes:
                self._check(fed, spec, max_total)
                ready.append(EpisodeState(spec, fed if spec.identity is None else int(spec.identity),
                                          [int(x) for x in spec.first]))
                fed += 1
            if idle and not item.episodes:
                raise RuntimeError("the episode feed gave an idle engine nothing and did not end; a feed must "
                                   "block until it has work (EpisodeFeed.more)")

        try:
            while ready or futures or any(s is not None for s in slots) or not feed_over:
                if feed is not None and feed.cancelled:  # dropped unfinished: their pages go back
                    held = [*ready, *futures.values(), *(e for e in slots if e is not None)]
                    m["cancelled_episodes"] = len(held)
                    for ep in held:
                        pages.release(ep)
                    break
                if feed is not None:
                    drop_specs(feed.take_drops())
                if futures and None in slots:
                    time.sleep(0)  # yield the GIL: steps just submitted (fast environments) can land before admission
                done = [f for f in futures if f.done()]
                ended = sum(finish_env(fut, futures.pop(fut)) for fut in done)
                if timeout and futures:
                    late = [f for f, e in futures.items() if time.monotonic() - e.submitted > timeout and not f.done()]
                    ended += sum(time_out(fut, futures.pop(fut)) for fut in late)
                in_flight -= ended
                if ended and on_finish is not None:
                    on_finish(ended)
                if not feed_over and in_flight < limit and all(e.admitted for e in ready):
                    take_feed()
                    if feed_over and not (ready or futures or any(s is not None for s in slots)):
                        break
                # admission: ready work into free slots, in queue order; an episode that cannot
                # get pages waits without blocking those behind it; a new episode also waits
                # for room under max_in_flight
                batch, skipped = [], set()
                if ready and all(s is None for s in slots):  # idle: the oldest ready episode first
                    head = next((e for e in ready if e.admitted or in_flight < limit), None)
                    while head is not None and not pages.grow(head, len(head.ctx) + min(K, head.cap)):
                        holders = [e for e in ready if e.pages and e is not head]
                        if not holders:
                            break
                        preempt(max(holders, key=lambda e: e.admitted))
                while ready and None in slots:
                    j = next((j for j, e in enumerate(ready) if id(e) not in skipped and (
                        e.admitted or in_flight < limit)), None)
                    if j is None:
                        break
                    ep = ready[j]
                    if not pages.grow(ep, len(ep.ctx) + min(K, ep.cap)):
                        m["admission_waits"] += not skipped
                        skipped.add(id(ep))
                        continue
                    del ready[j]
                    in_flight += ep.admitted == 0
                    ep.slot = slots.index(None)
                    slots[ep.slot] = ep
                    admitted += 1
                    if ep.admitted:  # a started episode back from its environment (or preempted)
                        m["max_ready_wait_s"] = max(m["max_ready_wait_s"], time.monotonic() - ep.ready_since)
                    ep.admitted = admitted
                    batch.append(ep)
                if batch:
                    tok, lp, raw, pools = self._prefill_batch(batch, params, pools, rng, sp, m, base_key)
                    for r, ep in enumerate(batch):
                        ep.cached = len(ep.ctx)
                        ep.turn, ep.lps, ep.raws = [int(tok[r])], [float(lp[r])], [float(raw[r])]
                        ep.vers = [version]
                        m["useful_tokens"] += 1
                        prev[ep.slot] = tok[r]
                        if turn_over(ep):
                            end_turn(ep)
                running = sorted((ep for ep in slots if ep is not None), key=lambda e: e.admitted)
                for ep in running:  # pages for this chunk; preempt the newest when the pool is full
                    while ep.slot is not None and not pages.grow(ep, ep.cached + min(K, ep.cap - len(ep.turn))):
                        newest = max((e for e in slots if e is not None), key=lambda e: e.admitted)
                        preempt(newest)
                occupied = [s for s, ep in enumerate(slots) if ep is not None]
                if occupied:  # the call carries the occupied slots only, in _rows(n) rows
                    R = self._rows(len(occupied))
                    rows = [slots[s] for s in occupied] + [None] * (R - len(occupied))
                    width = bucket(max(len(slots[s].pages) for s in occupied), (), 1)
                    live = np.asarray([ep is not None for ep in rows])
                    lengths = np.asarray([0 if ep is None else ep.cached for ep in rows], np.int32)
                    remaining = np.asarray([0 if ep is None else ep.cap - len(ep.turn) for ep in rows], np.int32)
                    eids = np.asarray([0 if ep is None else ep.eid for ep in rows], np.int32)
                    prev_rows = np.zeros(R, np.int32)
                    prev_rows[:len(occupied)] = prev[occupied]
                    rows_in = engine_calls.DecodeRows(prev_rows, lengths, live, remaining, page_table(rows, width),
                                                      eids, row_keys(rows, R, base_key))
                    (toks, lps, raws, n_gen), pools = engine_calls.decode(self.program, params, pools, rows_in, sp,
                                                                          rng)
                    toks, lps, raws, n_gen = (np.asarray(x) for x in (toks, lps, raws, n_gen))
                    m["decode_calls"] += 1
                    m["slot_steps"] += cfg.slots * K
                    m["row_steps"] += R * K
                    for r, s in enumerate(occupied):
                        ep = rows[r]
                        g = int(n_gen[r])
                        ep.turn += toks[r, :g].tolist()
                        ep.lps += lps[r, :g].tolist()
                        ep.raws += raws[r, :g].tolist()
                        ep.vers += [version] * g
                        ep.cached += g
                        m["useful_tokens"] += g
                        m["useful_slot_steps"] += g
                        if g:
                            prev[s] = toks[r, g - 1]
                        if turn_over(ep):
                            end_turn(ep)
                elif not batch:  # nothing runs: free pages for the first ready episode, or wait
                    head = next((e for e in ready if e.admitted or in_flight < limit), None)
                    holders = [e for e in ready if e.pages and e is not head]
                    stepping = [e for e in futures.values() if e.pages]
                    if head is None:
                        if futures:
                            wait_for_steps()
                    elif holders:  # pages other ready episodes hold: recompute the newest
                        preempt(max(holders, key=lambda e: e.admitted))
                    elif stepping:  # pages episodes in an environment step hold: the longest-running one's
                        preempt(min(stepping, key=lambda e: e.submitted))
                    elif futures:
                        wait_for_steps()
                    else:
                        raise RuntimeError("the page pool cannot hold the next episode")  # unreachable: checked
        finally:
            if pool is not None:
                pool.close()
                m["abandoned_threads"] = pool.abandoned
        m["peak_pages"] = pages.peak
        m["num_pages"] = num_pages
        m["leaked_pages"] = num_pages - len(pages.free)  # 0: every ended episode gave its pages back
        m["wall_s"] = time.perf_counter() - t0
        m["utilisation"] = m["useful_slot_steps"] / max(m["slot_steps"], 1)
        self.metrics = dict(m)
        return [ep.result for ep in eps]
