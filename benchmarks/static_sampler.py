"""Batched generation with a dense KV cache: a jitted prefill chunk plus a compiled decode loop.

No rollout uses this module (every rollout runs on :mod:`lopd_jax.rollout.engine`).
:class:`Sampler` is a plain lockstep ``generate`` for the greedy parity tests against
``transformers``, the decode benchmarks and ``bench_engine``'s static baseline.

One :meth:`Sampler.extend` call prefills one right-padded chunk of new ids per row and
then decodes one token per step in a ``while_loop`` until every row has emitted a stop id
or reached its cap. It returns per token the log-prob of the processed distribution it
sampled from (``logprobs``) and the model's temperature-1 log-prob (``raw_logprobs``,
equal to the training forward's). The cache is reused across turns (the caller passes
only the ids it has not seen); :meth:`Sampler.compact` drops finished rows. Shapes are
rounded to length buckets and parameters and sampling settings are traced, so new
parameters never recompile. Stop strings are applied on the host, rewinding the cache.
One process only. The sampling math: :mod:`lopd_jax.rollout.sampling`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.core.shapes import bucket
from lopd_jax.settings.sections import SamplingParams
from models.decoder import Decoder, KVCache
from models.partitioning import Rules
from benchmarks.decode_step import decode_step, from_layers, to_layers
from models.layer import layer_weights
from lopd_jax.rollout.sampling import processed_logprobs, sample_logits
from lopd_jax.rollout.scheduler import stop_string_cut

__all__ = ["BucketConfig", "DecodeCache", "Generation", "Sampler", "SamplingParams", "bucket",
           "processed_logprobs", "sample_logits"]

FINISH_STOP = "stop"
FINISH_STOP_STRING = "stop_string"
FINISH_LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Length buckets that bound recompilation.

    Each field lists allowed sizes (ascending); an empty tuple, or a size above the last
    entry, falls back to the next power of two that is at least ``minimum``. Batch
    buckets are further rounded up to a multiple of the mesh's batch shards.
    """

    chunk: tuple[int, ...] = ()
    new_tokens: tuple[int, ...] = ()
    cache: tuple[int, ...] = ()
    batch: tuple[int, ...] = ()
    minimum: int = 16

    def __post_init__(self):
        for name in ("chunk", "new_tokens", "cache", "batch"):
            b = getattr(self, name)
            if any(x <= 0 for x in b) or list(b) != sorted(b):
                raise ValueError(f"BucketConfig.{name}={b}: use positive sizes in ascending order")
        if self.minimum < 1:
            raise ValueError(f"BucketConfig.minimum must be >= 1, got {self.minimum}")


@dataclasses.dataclass
class DecodeCache:
    """A KV cache for ``batch`` caller-managed rows plus a host mirror of its lengths."""

    kv: KVCache
    lengths: np.ndarray

    @property
    def batch(self) -> int:
        """Rows in the cache (a batch bucket; unused rows have length 0)."""
        return int(self.kv.lengths.shape[0])

    @property
    def capacity(self) -> int:
        """Token slots per row."""
        return int(self.kv.k.shape[2])


@dataclasses.dataclass
class Generation:
    """What one turn generated, one entry per requested row (``None`` for idle rows).

    ``tokens[i]`` are the exact sampled ids (the stop id, when hit, is the last one);
    ``logprobs[i]`` / ``raw_logprobs[i]`` are aligned with them (see the module docstring);
    ``finish_reasons[i]`` is ``"stop"``, ``"stop_string"`` or ``"length"``.
    """

    tokens: list[np.ndarray | None]
    logprobs: list[np.ndarray | None]
    raw_logprobs: list[np.ndarray | None]
    finish_reasons: list[str | None]

    @property
    def lengths(self) -> list[int]:
        """Number of generated tokens per row (0 for idle rows)."""
        return [0 if t is None else len(t) for t in self.tokens]


def _prefill(call, head, kv: KVCache, chunk, chunk_len, block: int):
    """Write the chunk into the cache in blocks of ``block`` tokens (a scan, so a long
    prompt never builds [B, heads, C, T] attention scores at once); return the final
    hidden state at each row's last chunk token [B, D] (fp32) and the new cache."""
    B, C = chunk.shape
    P = min(block, C)
    base = kv.lengths
    last = jnp.maximum(chunk_len - 1, 0)

    def run(kv, j, ids):
        offs = j * P + jnp.arange(P, dtype=jnp.int32)
        h, kv = call(ids, positions=base[:, None] + offs[None], attention_mask=offs[None] < chunk_len[:, None],
                     cache=kv)
        pick = jnp.take_along_axis(h, (last % P)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
        return kv, pick, (last // P) == j

    if P == C:
        kv, h_last, _ = run(kv, 0, chunk)
        return h_last, kv
    n = C // P

    def body(carry, xs):
        kv, h_last = carry
        kv, pick, sel = run(kv, *xs)
        return (kv, jnp.where(sel[:, None], pick, h_last)), None

    xs = (jnp.arange(n, dtype=jnp.int32), chunk.reshape(B, n, P).swapaxes(0, 1))
    (kv, h_last), _ = jax.lax.scan(body, (kv, jnp.zeros((B, head.shape[0]), jnp.float32)), xs)
    return h_last, kv


def _decode_turn(graphdef, n_new: int, top_k: int, greedy: bool, unrolled: bool, stop_ids: tuple[int, ...],
                 lora: bool, pad_id: int, block: int, params, kv: KVCache, chunk, chunk_len, max_new, key,
                 temperature, top_p):
    """Prefill one chunk per row, then decode up to ``n_new`` tokens (see module docstring).

    ``greedy`` (static): every row takes its first maximal id (no sampling work);
    ``unrolled`` (static): the loop runs :func:`benchmarks.decode_step.decode_step` (per-layer
    weights and caches, see that module) instead of the decoder's scanned cached call."""
    model = nnx.merge(graphdef, params)
    B = chunk.shape[0]
    call = functools.partial(model, return_hidden=True, **({"lora": True} if lora else {}))
    head = model.lm_head_kernel()
    h_last, kv = _prefill(call, head, kv, chunk, chunk_len, block)
    stops = jnp.asarray(stop_ids, jnp.int32)

    def sample(hidden, t):
        logits = jnp.dot(hidden.astype(jnp.float32), head.astype(jnp.float32))
        return sample_logits(logits, jax.random.fold_in(key, t), temperature, top_p, top_k, greedy=greedy)

    if unrolled:
        layers = layer_weights(model, lora)

        def step(cache, prev, live):
            ks, vs, lengths = cache
            h, lengths, ks, vs = decode_step(model, layers, prev, lengths, live, ks, vs, lora)
            return h, (ks, vs, lengths)

        cache = (*to_layers(kv), kv.lengths)
    else:
        def step(cache, prev, live):
            h, cache = call(prev[:, None], positions=cache.lengths[:, None], attention_mask=live[:, None],
                            cache=cache)
            return h[:, 0], cache

        cache = kv

    active = (chunk_len > 0) & (max_new > 0)
    tok, lp, raw = sample(h_last, 0)
    tok = jnp.where(active, tok, pad_id)
    tokens = jnp.full((B, n_new), pad_id, jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((B, n_new), jnp.float32).at[:, 0].set(jnp.where(active, lp, 0.0))
    raws = jnp.zeros((B, n_new), jnp.float32).at[:, 0].set(jnp.where(active, raw, 0.0))
    n_gen = active.astype(jnp.int32)
    done = ~active | jnp.isin(tok, stops) | (n_gen >= max_new)

    def cond(s):
        return (s[-1] < n_new) & ~jnp.all(s[5])

    def body(s):
        cache, tokens, lps, raws, prev, done, n_gen, t = s
        live = ~done
        h, cache = step(cache, prev, live)
        tok, lp, raw = sample(h, t)
        tokens = tokens.at[:, t].set(jnp.where(live, tok, pad_id))
        lps = lps.at[:, t].set(jnp.where(live, lp, 0.0))
        raws = raws.at[:, t].set(jnp.where(live, raw, 0.0))
        n_gen = n_gen + live.astype(jnp.int32)
        done = done | jnp.isin(tok, stops) | (n_gen >= max_new)
        return cache, tokens, lps, raws, jnp.where(live, tok, prev), done, n_gen, t + 1

    state = (cache, tokens, lps, raws, tok, done, n_gen, jnp.int32(1))
    cache, tokens, lps, raws, _, _, n_gen, _ = jax.lax.while_loop(cond, body, state)
    kv = from_layers(*cache) if unrolled else cache
    return {"tokens": tokens, "logprobs": lps, "raw_logprobs": raws, "n_gen": n_gen}, kv


class Sampler:
    """Batched KV-cache sampler over a model's pure parameter state.

    Args:
      model: a :class:`models.decoder.Decoder` (or any nnx module with its ``__call__``
        cache interface, ``init_cache`` and ``lm_head_kernel``); only its graph is kept,
        parameters are passed to every call.
      stop_ids: end-of-turn ids (e.g. ``ChatFormat.stop_ids``).
      sampling: default :class:`SamplingParams`.
      buckets: :class:`BucketConfig`.
      rules: optional :class:`models.partitioning.Rules`; rows are sharded over the
        ``act_batch`` axes (data x fsdp) and the batch bucket is a multiple of that size.
      stop_strings / decode: optional host-side stop strings and the ``ids -> text``
        function used to find them (e.g. a tokenizer's ``decode``).
      lora: run the model with its LoRA adapters on.
      pad_id: id written in unused token slots.
      prefill_block: chunks longer than this are prefilled in blocks of this many tokens
        (bounds the attention scores of a long prompt; a power of two).
      decode_layers: how the decode loop runs the layers: ``"unrolled"``
        (:mod:`benchmarks.decode_step`: per-layer weights sliced once per turn and per-layer
        caches in attention layout -- several times faster on CPU, but holds a second copy
        of the weights during a turn), ``"scan"`` (the decoder's scanned cached call: one
        weight copy, compile time independent of depth -- for accelerators), or
        ``"auto"``: unrolled for a :class:`models.decoder.Decoder` on CPUs.
    """

    def __init__(self, model: nnx.Module, *, stop_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                 buckets: BucketConfig = BucketConfig(), rules: Rules | None = None,
                 stop_strings: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                 lora: bool = False, pad_id: int = 0, prefill_block: int = 256, decode_layers: str = "auto"):
        if decode_layers not in ("auto", "unrolled", "scan"):
            raise ValueError(f"decode_layers={decode_layers!r}: use auto, unrolled or scan")
        if prefill_block < 1 or prefill_block & (prefill_block - 1):
            raise ValueError(f"prefill_block must be a power of two, got {prefill_block}")
        if stop_strings and decode is None:
            raise ValueError("stop_strings need a decode function (ids -> text), e.g. tokenizer.decode")
        self.graphdef, _ = nnx.split(model)
        # Only the cache layout is kept (no reference to the model's arrays).
        self._cache_spec = jax.eval_shape(lambda: model.init_cache(1, 1))
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.sampling = sampling
        self.buckets = buckets
        self.rules = rules
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        self.lora = lora
        self.pad_id = int(pad_id)
        self.prefill_block = int(prefill_block)
        if decode_layers == "unrolled" and not isinstance(model, Decoder):
            raise ValueError("decode_layers='unrolled' needs a models.decoder.Decoder; use 'scan'")
        if decode_layers == "auto":
            devices = jax.devices() if rules is None else rules.mesh.devices.flat
            cpu = all(d.platform == "cpu" for d in devices)
            decode_layers = "unrolled" if cpu and isinstance(model, Decoder) else "scan"
        self.decode_layers = decode_layers
        self._compiled: dict[tuple, Callable] = {}
        if rules is not None and jax.process_count() > 1:
            raise ValueError("Sampler runs on one process; multi-host rollouts run on lopd_jax.rollout.engine.Engine")

    @staticmethod
    def params_of(model: nnx.Module) -> dict:
        """The model's parameter state as a pure dict (what every call takes as ``params``)."""
        return nnx.to_pure_dict(nnx.split(model)[1])

    @property
    def num_compiled(self) -> int:
        """How many distinct (shape bucket, static setting) variants have been built."""
        return len(self._compiled)

    # ----- shardings -----
    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over (1 without a mesh)."""
        if self.rules is None:
            return 1
        spec = self.rules.spec(("act_batch",))[0]
        axes = () if spec is None else ((spec,) if isinstance(spec, str) else spec)
        return int(np.prod([self.rules.mesh.shape[a] for a in axes])) if axes else 1

    def _batch_sharding(self, ndim: int):
        return None if self.rules is None else self.rules.sharding(("act_batch",) + (None,) * (ndim - 1))

    def _kv_sharding(self, kv: KVCache, shape=None):
        if self.rules is None:
            return None
        names = ("layers", "act_batch", None, "act_kv_heads", None)
        s = self.rules.sharding(names, kv.k.shape if shape is None else shape)
        return KVCache(s, s, self._batch_sharding(1))

    def _put(self, x, sharding):
        return jnp.asarray(x) if sharding is None else jax.device_put(x, sharding)

    # ----- cache management -----
    def batch_bucket(self, n: int) -> int:
        """Rows to allocate for ``n`` trajectories."""
        return bucket(n, self.buckets.batch, 1, self.batch_shards)

    def new_cache(self, batch: int, capacity: int | None = None) -> DecodeCache:
        """An empty cache of ``batch_bucket(batch)`` rows and a capacity bucket."""
        cap = bucket(capacity or self.buckets.minimum, self.buckets.cache, self.buckets.minimum)
        b = self.batch_bucket(batch)
        spec = self._cache_spec.k
        shape = (spec.shape[0], b, cap, *spec.shape[3:])
        zeros = functools.partial(jnp.zeros, shape, spec.dtype)
        if self.rules is not None:  # build each shard in place, never the whole cache on one device
            zeros = jax.jit(zeros, out_shardings=self._kv_sharding(self._cache_spec, shape).k)
        return self._set_kv(zeros(), zeros(), np.zeros(b, np.int64))

    def _set_kv(self, k, v, lengths: np.ndarray) -> DecodeCache:
        kv = KVCache(k, v, jnp.asarray(lengths, jnp.int32))
        if self.rules is not None:
            kv = jax.tree.map(self._put, kv, self._kv_sharding(kv))
        return DecodeCache(kv, np.asarray(lengths, np.int64))

    def grow(self, cache: DecodeCache, capacity: int) -> DecodeCache:
        """``cache`` with at least ``capacity`` slots per row (a cache bucket); contents kept."""
        cap = bucket(capacity, self.buckets.cache, self.buckets.minimum)
        if cap <= cache.capacity:
            return cache
        widths = ((0, 0), (0, 0), (0, cap - cache.capacity), (0, 0), (0, 0))
        return self._set_kv(jnp.pad(cache.kv.k, widths), jnp.pad(cache.kv.v, widths), cache.lengths)

    def compact(self, cache: DecodeCache, rows: Sequence[int]) -> DecodeCache:
        """Keep ``rows`` (in this order) in a ``batch_bucket(len(rows))``-row cache; the
        remaining new rows are empty."""
        b = self.batch_bucket(len(rows))
        take = np.zeros(b, np.int32)
        take[: len(rows)] = rows
        lengths = np.zeros(b, np.int64)
        lengths[: len(rows)] = cache.lengths[list(rows)]
        idx = jnp.asarray(take)
        return self._set_kv(jnp.take(cache.kv.k, idx, axis=1), jnp.take(cache.kv.v, idx, axis=1), lengths)

    # ----- generation -----
    def _fn(self, n_new: int, top_k: int, greedy: bool, shapes: tuple, kv: KVCache):
        key = (n_new, top_k, greedy, shapes)
        if key not in self._compiled:
            core = functools.partial(_decode_turn, self.graphdef, n_new, top_k, greedy,
                                     self.decode_layers == "unrolled", self.stop_ids, self.lora, self.pad_id,
                                     self.prefill_block)
            kw: dict[str, Any] = {"donate_argnums": (1,)}
            if self.rules is not None:
                b2 = self._batch_sharding(2)
                outs = {"tokens": b2, "logprobs": b2, "raw_logprobs": b2, "n_gen": self._batch_sharding(1)}
                kw["out_shardings"] = (outs, self._kv_sharding(kv))
            self._compiled[key] = jax.jit(core, **kw)
        return self._compiled[key]

    def extend(self, params, cache: DecodeCache, chunks: Sequence[Sequence[int] | None],
               max_new_tokens: int | Sequence[int], rng: jax.Array, *,
               sampling: SamplingParams | None = None,
               stop_strings: Sequence[str] | None = None) -> tuple[Generation, DecodeCache]:
        """Append ``chunks[i]`` to cache row ``i`` and generate one turn for each such row.

        Args:
          params: the model's pure parameter dict (:meth:`params_of`) -- e.g. the student's
            current parameters.
          cache: a :class:`DecodeCache` of at least ``len(chunks)`` rows; consumed (its
            buffers are donated) -- use the returned cache.
          chunks: per row, the ids the cache has not seen yet (at least one), or ``None``
            for a row that sits this turn out.
          max_new_tokens: per-row (or one shared) cap on generated tokens, >= 1.
          rng: PRNG key for this turn.
          sampling: overrides the default :class:`SamplingParams` for this call.
          stop_strings: overrides the sampler's stop strings for this call (host-side, so
            changing them never recompiles).

        Returns:
          ``(Generation, new cache)``.
        """
        sp = sampling or self.sampling
        stop_strings = self.stop_strings if stop_strings is None else tuple(stop_strings)
        if stop_strings and self.decode is None:
            raise ValueError("stop_strings need a decode function (ids -> text): Sampler(..., decode=...)")
        if len(chunks) > cache.batch:
            raise ValueError(f"{len(chunks)} chunks but the cache has {cache.batch} rows; "
                             "allocate with new_cache(len(chunks)) or compact first")
        caps = [max_new_tokens] * len(chunks) if np.isscalar(max_new_tokens) else list(max_new_tokens)
        if len(caps) != len(chunks):
            raise ValueError(f"max_new_tokens has {len(caps)} entries for {len(chunks)} chunks")
        B = cache.batch
        clen = np.zeros(B, np.int32)
        cap = np.zeros(B, np.int32)
        for i, (c, m) in enumerate(zip(chunks, caps)):
            if c is None:
                continue
            if len(c) == 0:
                raise ValueError(f"row {i}: an empty chunk; pass the ids the cache has not seen "
                                 "(at least the last generated id) or None to skip the row")
            if int(m) < 1:
                raise ValueError(f"row {i}: max_new_tokens must be >= 1, got {m}")
            clen[i], cap[i] = len(c), int(m)
        need = int((cache.lengths + clen + np.where(clen > 0, cap, 0)).max(initial=0))
        top_clen, top_cap = int(clen.max(initial=0)), int(cap.max(initial=0))
        if not top_clen:
            raise ValueError("extend needs at least one row with a chunk")
        C = bucket(top_clen, self.buckets.chunk, self.buckets.minimum)
        if C > self.prefill_block:
            C = -(-C // self.prefill_block) * self.prefill_block
        n_new = bucket(top_cap, self.buckets.new_tokens, self.buckets.minimum)
        ids = np.full((B, C), self.pad_id, np.int32)
        for i, c in enumerate(chunks):
            if c is not None:
                ids[i, : len(c)] = c
        cache = self.grow(cache, need)
        bs = self._batch_sharding
        shapes = (cache.batch, C, cache.capacity)
        fn = self._fn(n_new, sp.top_k, sp.temperature == 0, shapes, cache.kv)
        out, kv = fn(params, cache.kv, self._put(ids, bs(2)), self._put(clen, bs(1)), self._put(cap, bs(1)),
                     rng, jnp.float32(sp.temperature), jnp.float32(sp.top_p))
        out = jax.tree.map(np.asarray, out)
        n_gen = out["n_gen"].astype(np.int64)
        gen = Generation([None] * len(chunks), [None] * len(chunks), [None] * len(chunks), [None] * len(chunks))
        lengths = cache.lengths + clen + np.maximum(n_gen - 1, 0)
        for i in range(len(chunks)):
            if clen[i] == 0:
                continue
            n = int(n_gen[i])
            toks = out["tokens"][i, :n]
            reason = FINISH_STOP if n and int(toks[-1]) in self.stop_ids else FINISH_LENGTH
            if stop_strings:
                cut = stop_string_cut(toks, stop_strings, self.decode)
                if cut is not None and cut < n:
                    lengths[i] -= n - cut
                    n, toks, reason = cut, toks[:cut], FINISH_STOP_STRING
            gen.tokens[i] = toks.astype(np.int32)
            gen.logprobs[i] = out["logprobs"][i, :n]
            gen.raw_logprobs[i] = out["raw_logprobs"][i, :n]
            gen.finish_reasons[i] = reason
        if not np.array_equal(lengths, np.asarray(kv.lengths)):
            kv = kv._replace(lengths=self._put(np.asarray(lengths, np.int32), bs(1)))
        return gen, DecodeCache(kv, lengths)

    def generate(self, params, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 rng: jax.Array, *, sampling: SamplingParams | None = None) -> Generation:
        """One turn for each of ``prompts`` from a fresh cache (see :meth:`extend`)."""
        cache = self.new_cache(len(prompts))
        gen, _ = self.extend(params, cache, prompts, max_new_tokens, rng, sampling=sampling)
        return gen
