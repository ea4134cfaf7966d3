"""Peak memory of the LOPD loss + gradient: chunked LM head vs materialized logits.

Compiles (does not run, unless --run) value_and_grad of the LOPD objective w.r.t. the
student hidden states, the student LM head and the teacher hidden states, two ways:

* chunked:   lopd_objective (scan + remat over sequence chunks, logits never in full);
* unchunked: logits [B, S, V] materialized for student and teacher, then the plain
             topm_tail_reverse_kl and log_softmax gathers, same aggregation.

and prints XLA's memory_analysis() for each (temporaries are what chunking targets;
arguments and outputs -- hidden states, heads, their gradients -- are the same for both).

    python -m benchmarks.bench_chunked_loss                      # full size (slow compile)
    python -m benchmarks.bench_chunked_loss --vocab 8192 --tokens 1024 --hidden 256 --run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lopd_jax.method import losses as L  # noqa: E402
from lopd_jax.method.loss_config import LossConfig  # noqa: E402

GIB = 1024**3


def build_fns(args):
    """Return (chunked, unchunked) functions (sh, shead, th, thead, tgt, mask, adv) -> (loss, grads)."""
    compute = jnp.dtype(args.compute_dtype)
    cfg = LossConfig(margin=0.05, anchor_weight=0.0, composer_kl_weighting="token_mean", top_m=args.top_m,
                     logits_chunk=args.chunk_size)

    def chunked_loss(sh, shead, th, thead, tgt, mask, adv):
        loss, _ = L.lopd_objective(
            sh, shead, th, jax.lax.stop_gradient(thead), tgt, mask, adv, 0.5, loss=cfg, compute_dtype=compute,
        )
        return loss

    def unchunked_loss(sh, shead, th, thead, tgt, mask, adv):
        s_logits = jnp.dot(sh.astype(compute), shead.astype(compute)).astype(jnp.float32)
        t_logits = jnp.dot(th.astype(compute), jax.lax.stop_gradient(thead).astype(compute))
        t_logits = t_logits.astype(jnp.float32)
        pick = lambda lg: jnp.take_along_axis(  # noqa: E731
            jax.nn.log_softmax(lg), tgt[..., None], -1)[..., 0]
        stats = {
            "kl": L.topm_tail_reverse_kl(s_logits, t_logits, args.top_m),
            "student_logp": pick(s_logits),
            "teacher_logp": pick(t_logits),
        }
        loss, _ = L.lopd_loss_from_stats(stats, mask, adv, 0.5, loss=cfg)
        return loss

    def with_grad(fn):
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))

    return with_grad(chunked_loss), with_grad(unchunked_loss)


def shapes(args):
    """Abstract argument shapes (nothing is allocated for the compile)."""
    if args.tokens % args.batch:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --batch {args.batch}")
    b, s, d, v = args.batch, args.tokens // args.batch, args.hidden, args.vocab
    dt = jnp.dtype(args.dtype)
    sds = jax.ShapeDtypeStruct
    return (sds((b, s, d), dt), sds((d, v), dt), sds((b, s, d), dt), sds((d, v), dt),
            sds((b, s), jnp.int32), sds((b, s), jnp.float32), sds((b,), jnp.float32))


def report(name, compiled, seconds):
    """Print memory_analysis() figures for one compiled function; return temp bytes."""
    mem = compiled.memory_analysis()
    temp, arg, out = mem.temp_size_in_bytes, mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias = getattr(mem, "alias_size_in_bytes", 0)
    print(f"{name:>10}: temp {temp / GIB:8.3f} GiB | args {arg / GIB:6.3f} GiB | "
          f"outputs {out / GIB:6.3f} GiB | total {(temp + arg + out - alias) / GIB:8.3f} GiB "
          f"| compile {seconds:5.1f} s")
    return temp, temp + arg + out - alias


def run_check(args, chunked, unchunked):
    """Execute both on random data; print wall time and the agreement of loss and grads."""
    rng = np.random.default_rng(0)
    avals = shapes(args)
    b, s = avals[4].shape
    arrays = [jnp.asarray(rng.normal(size=a.shape) * (0.5 if a.ndim == 3 else 0.05), a.dtype)
              for a in avals[:4]]
    arrays += [jnp.asarray(rng.integers(0, args.vocab, (b, s)), jnp.int32),
               jnp.ones((b, s), jnp.float32), jnp.ones((b,), jnp.float32)]
    for name, fn in (("chunked", chunked), ("unchunked", unchunked)):
        jax.block_until_ready(fn(*arrays))
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*arrays))
        print(f"{name:>10}: loss {float(out[0]):.6f}  step {time.perf_counter() - t0:.3f} s")
        if name == "chunked":
            ref = out
    diffs = [float(jnp.max(jnp.abs(a - b_))) for a, b_ in zip(ref[1], out[1])]
    print(f"loss diff {abs(float(ref[0]) - float(out[0])):.2e}; max |grad diff| "
          f"(student_hidden, student_head, teacher_hidden) = {', '.join(f'{d:.2e}' for d in diffs)}")


def main(argv=None):
    """Parse flags, compile both variants, print memory figures and the ratio."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--tokens", type=int, default=8_192, help="B * S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1_024)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--top-m", type=int, default=20)
    p.add_argument("--dtype", default="float32", help="dtype of hidden states and heads")
    p.add_argument("--compute-dtype", default="float32", help="logits matmul dtype")
    p.add_argument("--skip-unchunked", action="store_true", help="compile only the chunked path")
    p.add_argument("--run", action="store_true", help="also execute both (small sizes only)")
    args = p.parse_args(argv)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; vocab {args.vocab}, "
          f"tokens {args.tokens} (batch {args.batch}), hidden {args.hidden}, chunk "
          f"{args.chunk_size}, top-M {args.top_m}, dtype {args.dtype}, compute {args.compute_dtype}")
    full_logits = args.tokens * args.vocab * 4
    print(f"one fp32 [tokens, vocab] array = {full_logits / GIB:.3f} GiB; one fp32 chunk "
          f"[batch, chunk, vocab] = {args.batch * args.chunk_size * args.vocab * 4 / GIB:.3f} GiB")
    chunked, unchunked = build_fns(args)
    avals = shapes(args)
    results = {}
    for name, fn in (("chunked", chunked), ("unchunked", unchunked)):
        if name == "unchunked" and args.skip_unchunked:
            continue
        t0 = time.perf_counter()
        compiled = fn.lower(*avals).compile()
        results[name] = report(name, compiled, time.perf_counter() - t0)
    if "unchunked" in results:
        (tc, pc), (tu, pu) = results["chunked"], results["unchunked"]
        print(f"ratio chunked/unchunked: temp {tc / tu:.4f} (1/{tu / tc:.1f}); "
              f"total {pc / pu:.4f} (1/{pu / pc:.1f}); goal temp <= 1/8: "
              f"{'met' if tc * 8 <= tu else 'NOT met'}")
    if args.run:
        run_check(args, chunked, unchunked)


if __name__ == "__main__":
    main()
