"""LOPD train step on real lengths: packed rows and length buckets vs every row padded to the cap (CPU).

The same tiny LOPD system and the same trajectories (``--rows`` lengths from
:func:`lopd_jax.planning.length_model.sample_lengths`, scaled to ``--cap``): *padded*
(:func:`train.steps.make_lopd_step` at the cap), *bucketed*
(:class:`train.bucketed_steps.BucketedLOPDStep` in passes of ``--buckets``) and *packed*
(the same step on :func:`train.packed_batches.packed_batch`: whole trajectories back to back
in rows of those lengths). Compiles are excluded, rounds alternate over the three on
``--batches`` draws and the ratios are of the summed medians; all train on the same real
tokens and their losses are printed (they agree to fp32).

    python -m benchmarks.bench_train_lengths
    python -m benchmarks.bench_train_lengths --rows 16 --buckets 256,512,1024,2048

Methodology and measurements: ``docs/length_buckets.md``, ``docs/packing.md``, ``docs/benchmarks.md``."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

def make_batch(lengths, cap: int, n_ret: int, exp_len: int, vocab: int, seed: int) -> dict:
    """A right-padded LOPD batch with rows of ``lengths`` tokens: a prompt (unsupervised)
    then assistant turns (supervised) and observations, random ids."""
    import numpy as np
    rng = np.random.default_rng(seed)
    B = len(lengths)
    tokens = np.zeros((B, cap), np.int32)
    amask = np.zeros((B, cap), bool)
    loss = np.zeros((B, cap), np.float32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(16, vocab, n)
        amask[b, :n] = True
        prompt = max(1, int(n * 0.2))
        loss[b, prompt:n] = (rng.random(n - prompt) < 0.7)  # assistant tokens among observations
    return {"tokens": tokens, "attention_mask": amask, "loss_mask": loss,
            "insert_at": np.ones(B, np.int32),
            "exp_tokens": rng.integers(16, vocab, (B, n_ret, exp_len)).astype(np.int32),
            "exp_mask": np.ones((B, n_ret, exp_len), bool),
            "rewards": rng.random(B).astype(np.float32)}


def main(argv=None):
    """Run the benchmark; the last line is the ratio."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_qwen3")
    p.add_argument("--rows", type=int, default=8, help="trajectories per step")
    p.add_argument("--cap", type=int, default=4096, help="total-token cap (the padded length)")
    p.add_argument("--buckets", default="256,512,1024,2048,3072", help="bucket lengths below the cap")
    p.add_argument("--batches", type=int, default=2, help="different draws of lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from lopd_jax.method.composer import ComposerConfig
    from lopd_jax.method.splice import SpliceLayout
    from lopd_jax.planning.length_model import sample_lengths
    from lopd_jax.settings.length_config import LengthConfig
    from models.config import LoraConfig, named_config
    from models.decoder import Decoder
    from train.bucketed_steps import BucketedLOPDStep, bucketed_batch
    from train.packed_batches import model_attention_length, packed_batch
    from train.steps import make_lopd_step
    from train.system import LOPDSystem
    from lopd_jax.settings.sections import StepConfig

    mcfg = named_config(args.model, lora=LoraConfig(rank=8, alpha=16.0), attention_impl="blockwise",
                        attention_block_q=256, attention_block_kv=256,
                        max_position_embeddings=2 * args.cap)
    composer = ComposerConfig(num_latents=8, depth=2, n_ret=3, lora=mcfg.lora)
    layout = SpliceLayout(before_ids=(11, 12, 13), after_ids=(14, 15), num_slots=24, slot_id=7)
    system = LOPDSystem.create(Decoder(mcfg, rngs=nnx.Rngs(0)), composer, layout,
                               StepConfig())
    buckets = LengthConfig(buckets=tuple(int(x) for x in args.buckets.split(","))).bucket_lengths(args.cap)
    scale = args.cap / 40_960
    print(f"model {args.model} ({mcfg.hidden_size} wide, {mcfg.num_layers} layers), {args.rows} rows per step, "
          f"cap {args.cap}, buckets {buckets}, distribution scaled by {scale:.3f}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}")

    state0, frozen = system.init_state()
    steps = {}
    totals = {"padded": 0.0, "bucketed": 0.0, "packed": 0.0}
    real_tokens = 0
    for i in range(args.batches):
        lengths = sample_lengths(LengthConfig(), args.rows, args.cap, seed=args.seed + i, scale=scale)
        np_batch = make_batch(lengths, args.cap, composer.n_ret, 64, mcfg.vocab_size, args.seed + i)
        batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
        bb = bucketed_batch(np_batch, buckets, args.rows * args.cap, 1).put(system)
        pb = packed_batch(np_batch, buckets, args.rows * args.cap, 1, layout,
                          model_attention_length(system.model_cfg)).put(system)
        real_tokens += int(lengths.sum())
        print(f"batch {i}: lengths {sorted(lengths.tolist(), reverse=True)} (mean {lengths.mean():.0f}); "
              f"bucketed passes (seq, rows) {[(p.seq, len(p.rows)) for p in bb.plan]}, row tokens "
              f"{bb.padded_tokens()}; packed passes (seq, rows, segments) "
              f"{[(p.seq, len(p.rows), p.segments) for p in pb.plan]}, row tokens {pb.padded_tokens()}; "
              f"padded {args.rows * args.cap}")
        if not steps:
            steps = {"padded": make_lopd_step(system, state0, batch), "bucketed": BucketedLOPDStep(system, state0),
                     "packed": BucketedLOPDStep(system, state0)}
        sides = {"padded": lambda s: steps["padded"](s, frozen, batch),
                 "bucketed": lambda s: steps["bucketed"](s, frozen, bb),
                 "packed": lambda s: steps["packed"](s, frozen, pb)}
        times = {k: [] for k in sides}
        losses = {}
        for k, fn in sides.items():  # first call: compiles
            t0 = time.perf_counter()
            _, m = fn(jax.tree.map(jnp.copy, state0))
            losses[k] = float(m["loss"])
            print(f"  {k}: first step (compiles) {time.perf_counter() - t0:.1f} s, loss {losses[k]:.6f}")
        for _ in range(args.repeats):
            for k, fn in sides.items():
                s = jax.tree.map(jnp.copy, state0)
                jax.block_until_ready(s)
                t0 = time.perf_counter()
                jax.block_until_ready(fn(s))
                times[k].append(time.perf_counter() - t0)
        for k in sides:
            med = statistics.median(times[k])
            totals[k] += med
            print(f"  {k}: step median {med:.3f} s (of {', '.join(f'{t:.3f}' for t in times[k])})")
        print("  loss relative difference to padded: " + ", ".join(
            f"{k} {abs(losses[k] - losses['padded']) / abs(losses['padded']):.2e}" for k in ("bucketed", "packed")))
    for k in totals:
        print(f"{k}: {real_tokens / totals[k]:.0f} real tokens/s (step medians summed {totals[k]:.3f} s)")
    print(f"load after {os.getloadavg()[0]:.2f}")
    print(f"train step: packed/padded real tokens/s = {totals['padded'] / totals['packed']:.2f}x "
          f"(bucketed {totals['padded'] / totals['bucketed']:.2f}x)")

if __name__ == "__main__":
    main()
