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

Every decision above is the run's :class:`~lopd_jax.rollout.scheduler.Scheduler` (no JAX);
:meth:`Engine.run` runs :func:`drive`, the loop that asks it for the next device call, runs the
call and hands the numpy results back, timing host and device (:class:`EngineTiming`). An engine
keeps one environment-step thread pool across its runs (:meth:`Engine.close`).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.settings.sections import EngineConfig, SamplingParams
from models.decoder import Decoder
from lopd_jax.rollout import engine_calls
from lopd_jax.rollout import layout as inference_layout
from lopd_jax.rollout.engine_calls import key_data
from lopd_jax.rollout.env_threads import EnvThreads
from lopd_jax.rollout.episode_spec import EpisodeFeed, EpisodeResult, EpisodeSpec
from lopd_jax.rollout.paged_step import empty_pools
from lopd_jax.rollout.scheduler import DecodePlan, Prefill, Scheduler, check_episode, row_sizes

__all__ = ["Engine", "EngineTiming", "drive"]


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
        self.last_timing: EngineTiming | None = None  # where the last run's time went
        self._pool_makers: dict[int, Callable] = {}
        self._env_threads: EnvThreads | None = None

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

    # ----- device calls -----
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.config.page_size)

    @property
    def program(self) -> engine_calls.Program:
        """The static part of every device call (:class:`lopd_jax.rollout.engine_calls.Program`)."""
        return engine_calls.Program(self.graphdef, self.lora, self.mesh, self.stop_ids, self.config.decode_chunk)

    @staticmethod
    def _device_sampling(sp: SamplingParams) -> SamplingParams:
        """``sp`` with float32 scalar leaves, as every device call takes it (one compiled variant)."""
        return jax.tree.map(jnp.float32, sp)

    def precompile(self, params, max_total: int, sampling: SamplingParams | None = None) -> int:
        """Compile (by running once on a scratch pool) every prefill and decode variant a run
        with episodes of up to ``max_total`` tokens can meet: one per power-of-two count of
        pages read and row count (:func:`~lopd_jax.rollout.scheduler.row_count`). Returns the
        number of variants."""
        sp = self._device_sampling(sampling or self.sampling)
        cfg, n = self.config, 0
        row_pages = self._pages_for(max_total)
        params = self.local_params(params)
        pools = self._empty_pools(cfg.num_pages or cfg.slots * row_pages)
        C = cfg.prefill_chunk
        key = self.local_key(jax.random.key(0))  # placed as run places its key (same compiled variant)
        w = 1
        while True:
            for S in row_sizes(cfg.slots):
                z, table = np.zeros(S, np.int32), np.zeros((S, w), np.int32)
                rows = engine_calls.PrefillRows(np.zeros((S, C), np.int32), z, z, table, z)
                _, pools = engine_calls.prefill(self.program.model_part(), params, pools, rows, sp, key)  # as run
                rows = engine_calls.DecodeRows(z, z, np.zeros(S, bool), z, table, z)
                _, pools = engine_calls.decode(self.program, params, pools, rows, sp, key)
                n += 2
            if w >= row_pages:
                return n
            w *= 2

    # ----- environment threads -----
    def _env_pool(self) -> EnvThreads | None:
        """The engine's environment-step threads (``env_workers`` of them; None: steps run
        inline), made on the first run that needs them and kept for every later run."""
        if not self.config.env_workers:
            return None
        if self._env_threads is None:
            self._env_threads = EnvThreads(self.config.env_workers)
            self._closer = weakref.finalize(self, self._env_threads.close)  # also runs at interpreter exit
        return self._env_threads

    def close(self) -> None:
        """Let the engine's environment threads exit (a later :meth:`run` makes new ones).
        Also done when the engine is garbage-collected, at interpreter exit, and on leaving
        ``with engine:``."""
        if self._env_threads is not None:
            self._closer()
            self._env_threads = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- the loop -----
    def run(self, params, episodes: Sequence[EpisodeSpec], rng: jax.Array, sampling: SamplingParams | None = None,
            *, first_id: int = 0, on_finish: Callable[[int], None] | None = None,
            feed: EpisodeFeed | None = None, version: int = 0) -> list[EpisodeResult]:
        """Run every episode to its end; results in input order. Metrics of the run are in
        :attr:`metrics`, where its time went in :attr:`last_timing`.

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
        self.last_timing = None
        if not episodes and feed is None:
            return []
        sched, device = self._start(params, episodes, rng, sampling, first_id, on_finish, feed, version)
        pool, t0 = sched.pool, time.perf_counter()
        abandoned = pool.abandoned if pool is not None else 0
        try:
            drive(sched, device)
        finally:
            if pool is not None:
                sched.m["abandoned_threads"] = pool.abandoned - abandoned
                for fut in sched.futures:  # a cancelled or failed run's steps: they must not hold the pool
                    pool.abandon(fut, count=False)
        m = sched.finish()
        self.last_timing = EngineTiming(time.perf_counter() - t0, device.seconds, sched.env_wait_s,
                                        m.get("decode_calls", 0), m.get("prefill_calls", 0))
        self.metrics = {**m, "wall_s": self.last_timing.wall_s, **self.last_timing.record()}
        return [ep.result for ep in sched.eps]

    def _start(self, params, episodes: Sequence[EpisodeSpec], rng, sampling: SamplingParams | None, first_id: int,
               on_finish, feed: EpisodeFeed | None, version: int) -> tuple[Scheduler, "_DeviceCalls"]:
        """A run's scheduler and device state, after checking its episodes against the pool."""
        cfg = self.config
        max_total = max([e.max_total for e in episodes] + ([feed.max_total] if feed is not None else []))
        row_pages = self._pages_for(max_total)
        num_pages = cfg.num_pages or cfg.slots * row_pages
        if num_pages < row_pages:
            raise ValueError(f"EngineConfig.num_pages={num_pages} cannot hold one episode of "
                             f"{max_total} tokens ({row_pages} pages of {cfg.page_size}); raise it")
        for i, e in enumerate(episodes):
            check_episode(i, e, max_total)
        params, rng = self.local_params(params), self.local_key(rng)
        base_key = key_data(rng) if feed is not None or any(e.rng is not None for e in episodes) else None
        device = _DeviceCalls(self.program, self._empty_pools(num_pages), rng,
                              self._device_sampling(sampling or self.sampling))
        sched = Scheduler(cfg, episodes, num_pages=num_pages, max_total=max_total, params=params, version=version,
                          local_params=self.local_params, stop_ids=self.stop_ids, stop_strings=self.stop_strings,
                          decode=self.decode, pad_id=self.pad_id, first_id=first_id, feed=feed, on_finish=on_finish,
                          base_key=base_key, pool=self._env_pool())
        return sched, device


def drive(sched: Scheduler, device) -> None:
    """The engine's loop until the run is over: ask ``sched`` for the next device call, run
    it on ``device`` (:class:`_DeviceCalls`, or a stand-in with its ``prefill`` / ``decode``:
    ``benchmarks/host_time.py`` times this loop's host work with one) and hand the numpy
    results back; when nothing can run, let the scheduler free pages or wait."""
    while sched.poll():
        batch = sched.admit()
        if batch:
            sched.start_turns(device.prefill(sched.prefill(batch), sched.params))
        plan = sched.plan_decode()
        if plan is not None:
            sched.take_decode(plan, *device.decode(plan, sched.params))
        elif not batch:
            sched.unblock()


@dataclasses.dataclass(frozen=True)
class EngineTiming:
    """Where one :meth:`Engine.run`'s wall time went. ``device_s``: in device calls, from
    dispatch until their results are on the host (the engine waits on the device);
    ``env_wait_s``: blocked on environment steps with nothing to decode; the rest,
    :attr:`host_s`, is Python between device calls (scheduling, appending tokens, rows)."""

    wall_s: float
    device_s: float
    env_wait_s: float
    decode_chunks: int
    prefill_calls: int

    @property
    def host_s(self) -> float:
        """Host seconds between device calls (wall time less device and environment waits)."""
        return max(0.0, self.wall_s - self.device_s - self.env_wait_s)

    @property
    def host_ms_per_chunk(self) -> float:
        """Host milliseconds per decode chunk (0 for a run without one)."""
        return 1e3 * self.host_s / self.decode_chunks if self.decode_chunks else 0.0

    def record(self, prefix: str = "engine_") -> dict[str, float]:
        """The run's times for its records (wall-clock: every name ends in ``seconds``):
        ``host_seconds``, ``device_wait_seconds``, ``env_wait_seconds`` and
        ``host_seconds_per_chunk``, each after ``prefix``."""
        return {prefix + "host_seconds": self.host_s, prefix + "device_wait_seconds": self.device_s,
                prefix + "env_wait_seconds": self.env_wait_s,
                prefix + "host_seconds_per_chunk": self.host_ms_per_chunk / 1e3}


class _DeviceCalls:
    """One run's device state (page pools, key, sampling) and its two calls, each returning
    numpy results and counting its seconds from dispatch to results on the host."""

    def __init__(self, program: engine_calls.Program, pools, rng, sampling: SamplingParams):
        self.program, self.pools, self.rng, self.sampling = program, pools, rng, sampling
        self.seconds = 0.0

    def prefill(self, prefill: Prefill, params) -> Prefill:
        """Feed every piece of ``prefill`` (one call each); returns it with its first tokens."""
        while (rows := prefill.next_piece()) is not None:
            t = time.perf_counter()
            out, self.pools = engine_calls.prefill(self.program.model_part(), params, self.pools, rows, self.sampling,
                                                   self.rng)
            tok, lp, raw = (np.asarray(x) for x in out)
            self.seconds += time.perf_counter() - t
            prefill.take(tok, lp, raw)
        return prefill

    def decode(self, plan: DecodePlan, params) -> tuple[np.ndarray, ...]:
        """One decode chunk of ``plan``'s rows: ``(tokens, log-probs, raw log-probs, generated)``."""
        t = time.perf_counter()
        out, self.pools = engine_calls.decode(self.program, params, self.pools, plan.inputs, self.sampling, self.rng)
        out = tuple(np.asarray(x) for x in out)
        self.seconds += time.perf_counter() - t
        return out
