"""Host cost of the rollout engine and of the trainer's batch building at the paper's shapes,
with the device stubbed: ``python -m benchmarks.host_time``.

**Engine.** The real :class:`lopd_jax.rollout.scheduler.Scheduler` driven by the engine's own
loop (:func:`lopd_jax.rollout.engine.drive`) at the paper config's engine (``configs/qwen3_8b.py``:
64 slots, decode chunk 16, its page size and pool), on episodes whose prompt, turn and
observation lengths are drawn from its ``lengths.*`` distribution under its rollout caps
(:func:`lopd_jax.planning.engine_schedule.draw_episodes`). The device calls are a stub
(:class:`StubDevice`) that returns at once the tokens a model would: a stop id where the drawn
turn ends, other ids elsewhere, each a function of the episode and the position only (as the
engine's keys make the real ones). Environment steps run inline and return the drawn
observation at once. Host time is the loop's wall time less the stub's own.

**Trainer.** The LOPD arm's batch (:func:`train.batches.lopd_batch`: padded arrays, FAISS
retrieval from a hashing-embedder bank, the composer's experience inputs; then
:meth:`train.run_context.RunContext.bucketed`: the pack plan, packed rows, teacher rows with
latent blocks) for the paper batch, 32 trajectories of drawn lengths on the config's
``v5p-32`` layout: each of the 4 hosts builds its 8 rows, then packs all 32. The device step
is not run.

**Device time** of both is what the compile checks price for qwen3_8b on v5p-32
(:func:`lopd_jax.programs.compile_rl_step.step_times`, nothing compiled): per decode chunk,
``decode_chunk`` steps of the weight shard plus the KV of each chunk's rows (their cached
context plus half a kernel block, as ``compile_sampler``'s roofline counts it), summed over
the chunks this run made; per training step, ``compile_check --estimate_only``'s packed LOPD
step at peak over ``--mfu``. Last line::

    host time: engine H.HH ms per chunk = P.P% of device, trainer B.BB s per step = Q.Q% of device

``--profile`` also prints the five largest self-time costs of the engine's host loop
(cProfile). Numbers: docs/benchmarks.md, "Host time".
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time
import types

import numpy as np

from configs import load_config
from lopd_jax.core.types import Task
from lopd_jax.method.bank import Experience, ExperienceBank
from lopd_jax.planning.engine_schedule import Episode, draw_episodes
from lopd_jax.rollout.engine import drive
from lopd_jax.rollout.episode_spec import EpisodeSpec
from lopd_jax.rollout.episodes import Trajectory
from lopd_jax.rollout.scheduler import Scheduler
from lopd_jax.programs.compile_rl_step import step_times
from lopd_jax.settings.overrides import apply_overrides
from train.bank_stage import make_embedder
from train.batches import lopd_batch
from train.run_context import RunContext, run_tokenizer
from train.step_spec import splice_layout, step_spec

KERNEL_PAGES_PER_BLOCK = 8  # lopd_jax.programs.compile_sampler's: each running row reads half a block more
STOP, VOCAB = 151_645, 151_643  # Qwen3's <|im_end|> and its base vocabulary


# ----- the engine -----
class StubDevice:
    """The engine's two device calls (:class:`lopd_jax.rollout.engine._DeviceCalls`' interface)
    answered at once on the host: token ``p`` of episode ``e`` is :data:`STOP` where the drawn
    turn ends, else an id hashed from ``(e, p)``. ``seconds``: the stub's own time (not host
    cost); ``chunk_context``: each decode call's cached context over its live rows."""

    def __init__(self, episodes: dict[int, Episode], K: int):
        self.K, self.seconds, self.chunk_context, self.live_rows = K, 0.0, [], []
        self.ends = {e: _turn_ends(ep) for e, ep in episodes.items()}
        self.end_sets = {e: set(x.tolist()) for e, x in self.ends.items()}

    def _token(self, eid: int, pos: int) -> int:
        return STOP if pos in self.end_sets[eid] else (eid * 7919 + pos * 104_729) % VOCAB

    def prefill(self, prefill, params):
        """Every piece of ``prefill`` (a :class:`~lopd_jax.rollout.scheduler.Prefill`), its
        sampled tokens back; as :meth:`lopd_jax.rollout.engine._DeviceCalls.prefill`."""
        while (rows := prefill.next_piece()) is not None:
            t = time.perf_counter()
            tok = np.asarray([self._token(int(e), int(s + n)) for e, s, n in zip(rows.eids, rows.start, rows.n)],
                             np.int32)
            zeros = np.zeros(len(tok), np.float32)
            self.seconds += time.perf_counter() - t
            prefill.take(tok, zeros, zeros)
        return prefill

    def decode(self, plan, params):
        """One chunk of ``plan``'s rows: ``(tokens, log-probs, raw log-probs, generated)``,
        each live row stopping at its turn's end or its remaining budget."""
        t = time.perf_counter()
        rows = plan.inputs
        B, K = len(rows.prev), self.K
        live = np.asarray(rows.live, bool)
        lengths = np.asarray(rows.lengths, np.int64)
        pos = lengths[:, None] + 1 + np.arange(K)[None, :]
        toks = ((np.asarray(rows.eids, np.int64)[:, None] * 7919 + pos * 104_729) % VOCAB).astype(np.int32)
        n_gen = np.zeros(B, np.int32)
        for r in np.flatnonzero(live):
            ends = self.ends[int(rows.eids[r])]
            i = int(np.searchsorted(ends, pos[r, 0]))
            to_end = int(ends[i] - pos[r, 0]) if i < len(ends) else K
            if to_end < K:
                toks[r, to_end] = STOP
            n_gen[r] = min(K, int(rows.remaining[r]), to_end + 1)
        self.chunk_context.append(int(lengths[live].sum()))
        self.live_rows.append(int(live.sum()))
        lp = np.zeros((B, K), np.float32)
        self.seconds += time.perf_counter() - t
        return toks, lp, lp, n_gen


def _turn_ends(ep: Episode) -> np.ndarray:
    """Context positions of the last token of each of ``ep``'s turns."""
    ends, pos = [], ep.prompt
    for j, t in enumerate(ep.turns):
        ends.append(pos + t - 1)
        pos += t + (ep.obs[j] if j < len(ep.obs) else 0)
    return np.asarray(ends, np.int64)


def _step(ep: Episode):
    """The episode's environment: the drawn observation after each turn, None after the last."""
    state = {"turn": 0}

    def step(ids, lps, raws):
        j = state["turn"]
        state["turn"] += 1
        return None if j >= len(ep.obs) else [11] * ep.obs[j]
    return step


def engine_host(cfg, episodes: int, seed: int, profile: bool = False) -> dict:
    """One engine run of ``episodes`` drawn episodes on the stub device: host seconds, decode
    chunks, live rows and context per chunk, the scheduler's metrics (and a profile)."""
    e, caps = cfg.engine, cfg.rollout.caps
    eps = draw_episodes(cfg.lengths, episodes, caps.max_env_steps, caps.max_turn_tokens, caps.max_total_tokens,
                        seed=seed)
    rng = np.random.default_rng(seed)
    specs = [EpisodeSpec(rng.integers(0, VOCAB, ep.prompt).tolist(), caps.max_total_tokens, caps.max_turn_tokens,
                         _step(ep)) for ep in eps]
    ecfg = dataclasses.replace(e, env_workers=0)  # instant environments, inline
    sched = Scheduler(ecfg, specs, num_pages=e.num_pages, max_total=caps.max_total_tokens, stop_ids=(STOP,))
    device = StubDevice(dict(enumerate(eps)), e.decode_chunk)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    drive(sched, device)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    m = sched.finish()
    out = {"host_s": wall - device.seconds - sched.env_wait_s, "wall_s": wall, "stub_s": device.seconds,
           "chunks": m["decode_calls"], "prefill_calls": m.get("prefill_calls", 0),
           "preemptions": m.get("preemptions", 0),
           "live_rows": np.asarray(device.live_rows), "chunk_context": np.asarray(device.chunk_context),
           "tokens": m["useful_tokens"]}
    if prof is not None:
        out["profile"] = prof
    return out


def top_costs(prof: cProfile.Profile, n: int = 5) -> list[tuple[str, float, int]]:
    """The ``n`` largest self-time entries of a profile of the engine's loop: ``(function,
    seconds, calls)``, leaving out the stub device (this module) and what only it calls."""
    stats = pstats.Stats(prof, stream=io.StringIO()).stats
    stub = {k for k in stats if k[0].endswith("host_time.py")}
    grew = True
    while grew:  # functions called from the stub alone, transitively
        more = {k for k, v in stats.items() if k not in stub and v[4] and set(v[4]) <= stub}
        stub |= more
        grew = bool(more)
    rows = sorted(((v[2], v[1], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})") for k, v in stats.items() if k not in stub),
                  reverse=True)
    return [(name, tt, calls) for tt, calls, name in rows[:n]]


# ----- the trainer -----
class HostContext(RunContext):
    """The run context's host part for batch building (tokenizer, step shapes, splice layout,
    batch shards): :class:`train.run_context.RunContext`'s own batch methods, without the
    model, mesh, engine or task source (what a device step would need)."""

    def __init__(self, cfg, shards: int):  # noqa: D107 -- RunContext's __init__ builds the model
        self.cfg, self.spec = cfg, step_spec(cfg)
        self.model_cfg = self.spec.model
        self.tokenizer = run_tokenizer(cfg, self.model_cfg.family, lambda: None)
        self.fmt, self.block, self.layout = splice_layout(cfg, self.model_cfg.family, self.tokenizer)
        self.system = types.SimpleNamespace(layout=self.layout, model_cfg=self.model_cfg)
        self._shards = shards

    @property
    def batch_shards(self) -> int:
        """The slice's batch shards (``mesh.data x mesh.fsdp``)."""
        return self._shards

    def local_rows(self, rows: int) -> tuple[int, int]:
        """Every row (one process builds what each host builds, one host at a time)."""
        return 0, rows


def _words(rng, n: int) -> str:
    return " ".join(f"w{int(x)}" for x in rng.integers(0, 5000, n))


def _experience(rng, i: int, task: Task) -> Experience:
    """A bank entry like an EnvScaler rollout: the task, then turns of tool calls and observations."""
    msgs = [{"role": "system", "content": _words(rng, 60)}, {"role": "user", "content": task.instruction}]
    for j in range(int(rng.integers(3, 12))):
        msgs.append({"role": "assistant", "content": _words(rng, 40),
                     "tool_calls": [{"name": f"tool_{j % 7}", "arguments": {"id": int(rng.integers(1000))}}]})
        msgs.append({"role": "tool", "content": _words(rng, 120)})
    return Experience(task.task_id, task.env_id, task.instruction, msgs, 1.0)


def _trajectory(rng, task: Task, ep: Episode, insert_at: int) -> Trajectory:
    """A finished rollout of ``ep``'s lengths (ids, turn mask, log-probs)."""
    mask = np.zeros(ep.total, np.float32)
    pos = ep.prompt
    for j, t in enumerate(ep.turns):
        mask[pos:pos + t] = 1.0
        pos += t + (ep.obs[j] if j < len(ep.obs) else 0)
    lps = -rng.random(ep.total).astype(np.float32)
    return Trajectory(task, rng.integers(0, VOCAB, ep.total).astype(np.int32), mask, lps, lps, [], [], 1.0, {},
                      len(ep.turns), list(ep.turns), insert_at, "done")


def trainer_host(cfg, ctx: HostContext, bank: ExperienceBank, tasks: list[Task], hosts: int, seed: int) -> dict:
    """One step's batch on every host (:meth:`train.arms.lopd.LOPDArm.batch`: each host's rows,
    then the packed passes of all of them): seconds per host, mean, and the passes made."""
    caps, rows = cfg.rollout.caps, cfg.env.tasks_per_step * cfg.env.group_size
    eps = draw_episodes(cfg.lengths, rows, caps.max_env_steps, caps.max_turn_tokens, caps.max_total_tokens,
                        seed=seed)
    rng = np.random.default_rng(seed)
    picked = [tasks[int(i)] for i in rng.integers(0, len(tasks), rows)]
    trajs = [_trajectory(rng, t, ep, min(40, ep.prompt - 1)) for t, ep in zip(picked, eps)]
    per = rows // hosts
    own = []
    for h in range(hosts):  # this host's rows: padded arrays, retrieval, experience inputs
        t0 = time.perf_counter()
        lopd_batch(ctx, trajs[h * per:(h + 1) * per], bank)
        own.append(time.perf_counter() - t0)
    whole = lopd_batch(ctx, trajs, bank)  # every host's rows, as gather_rows gives them (not timed)
    t0 = time.perf_counter()
    packed = ctx.bucketed(whole)  # the pack plan, packed rows, teacher rows with latent blocks
    pack = time.perf_counter() - t0
    return {"own_s": float(np.mean(own)), "pack_s": pack, "step_s": float(np.mean(own)) + pack,
            "passes": len(packed.passes), "tokens": int(sum(ep.total for ep in eps))}


def paper_bank(cfg, tasks: int, entries: int, seed: int) -> tuple[ExperienceBank, list[Task]]:
    """A hashing-embedder bank (the paper config's) of ``entries`` experiences over ``tasks`` tasks."""
    rng = np.random.default_rng(seed)
    ts = [Task(f"t{i}", f"env{i % 40}", f"Task {i}: " + _words(rng, 50), family=f"f{i % 40}") for i in range(tasks)]
    bank = ExperienceBank(make_embedder(cfg), cfg.bank_config())
    bank.add_many([_experience(rng, i, ts[i % tasks]) for i in range(entries)])
    return bank.build(), ts


# ----- the report -----
def device_times(cfg, topology: str, mfu: float) -> tuple[float, float, float]:
    """``(decode step weights s, KV s per context token, training step s)`` of ``cfg`` on
    ``topology`` (:func:`lopd_jax.programs.compile_rl_step.step_times`)."""
    times, _ = step_times(cfg, topology, mfu, env_steps=0)
    return times.decode_weights_s, times.decode_kv_s_per_token, times.train_s


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3_8b")
    p.add_argument("--topology", default="v5p-32")
    p.add_argument("--mfu", type=float, default=0.4, help="the training step's MFU (as compile_sampler --rl_step)")
    p.add_argument("--episodes", type=int, default=512, help="engine: episodes of the run (enough to keep most slots busy)")
    p.add_argument("--steps", type=int, default=3, help="trainer: step batches built (a fresh draw each)")
    p.add_argument("--hosts", type=int, default=4, help="trainer: hosts the batch's rows are split over (v5p-32: 4)")
    p.add_argument("--chips", type=int, default=16, help="trainer: chips of the slice (v5p-32: 16; batch shards)")
    p.add_argument("--bank", type=int, default=1000, help="trainer: bank entries")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also profile the engine's host loop (top five)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key=value")
    return p.parse_args(argv)


def report_engine(args, cfg, weights_s: float, kv_s: float) -> tuple[float, float]:
    """Run and print the engine part; ``(host ms, device ms)`` per decode chunk."""
    e = cfg.engine
    run = engine_host(cfg, args.episodes, args.seed)
    block = KERNEL_PAGES_PER_BLOCK * e.page_size / 2
    device_chunk = e.decode_chunk * (weights_s + (run["chunk_context"] + block * run["live_rows"]) * kv_s)
    host_ms = 1e3 * run["host_s"] / max(run["chunks"], 1)
    device_ms = 1e3 * float(device_chunk.mean())
    print(f"engine  config={args.config} slots {e.slots} chunk {e.decode_chunk} pages {e.num_pages:,} x "
          f"{e.page_size}: {args.episodes} episodes, {run['tokens']:,} tokens, {run['chunks']} decode chunks "
          f"({run['live_rows'].mean():.1f} live rows each), {run['prefill_calls']} prefill calls, "
          f"{run['preemptions']} preemptions; host {run['host_s']:.2f} s (stub {run['stub_s']:.2f} s)")
    print(f"  host {host_ms:.2f} ms per chunk; device {device_ms:.2f} ms per chunk on {args.topology} "
          f"({1e3 * weights_s:.2f} ms + {1e9 * kv_s:.2f} ns per context token per decode step)")
    if args.profile:
        print("  engine host loop, top five self times (cProfile; a second run, the profiler's overhead in it):")
        for name, tt, calls in top_costs(engine_host(cfg, args.episodes, args.seed, profile=True)["profile"]):
            print(f"    {tt:7.3f} s  {calls:>8} calls  {name}")
    return host_ms, device_ms


def report_trainer(args, cfg, train_s: float) -> float:
    """Run and print the trainer part; host seconds per step."""
    data, fsdp, _ = cfg.mesh.shape(args.chips)
    ctx = HostContext(cfg, data * fsdp)
    bank, tasks = paper_bank(cfg, 400, args.bank, args.seed)
    trainer_host(cfg, ctx, bank, tasks, args.hosts, args.seed + 10_000)  # warm-up (first tokenizer, index calls)
    steps = [trainer_host(cfg, ctx, bank, tasks, args.hosts, args.seed + s) for s in range(args.steps)]
    mean = {k: float(np.mean([s[k] for s in steps])) for k in steps[0]}
    print(f"trainer  batch {cfg.env.tasks_per_step * cfg.env.group_size} over {args.hosts} hosts, {args.steps} "
          f"steps: own rows {mean['own_s']:.3f} s + packing all {mean['pack_s']:.3f} s ({mean['passes']:.1f} "
          f"passes, {mean['tokens']:,.0f} tokens); device step {train_s:.2f} s")
    return mean["step_s"]


def main(argv=None) -> int:
    """Run both parts; print each part's figures and the last line."""
    args = parse_args(argv)
    cfg = apply_overrides(load_config(args.config), args.overrides)
    weights_s, kv_s, train_s = device_times(cfg, args.topology, args.mfu)
    host_ms, device_ms = report_engine(args, cfg, weights_s, kv_s)
    step_s = report_trainer(args, cfg, train_s)
    print(f"host time: engine {host_ms:.2f} ms per chunk = {100 * host_ms / device_ms:.1f}% of device, "
          f"trainer {step_s:.2f} s per step = {100 * step_s / train_s:.1f}% of device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
