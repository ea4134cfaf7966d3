"""Cost of the LOPD step's margin metrics, against the plain gradient in the same run.

    python -m benchmarks.bench_margin_metrics [--model=tiny_qwen3] [--batch=4] [--seq=256] [--reps=5]

Times, jitted, on one LOPD objective (:func:`train.steps.lopd_loss`):

* ``value_and_grad``: the loss's gradients alone (the baseline);
* ``lopd_grads``: the same gradients plus each term's composer gradient (one forward,
  three pullbacks, :func:`train.steps.lopd_grads`) and their shares;
* ``plain teacher``: the teacher forward without latents that ``delta_vs_plain_teacher``
  adds inside the loss (already inside both timings above).

Prints each time and its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.method.composer import ComposerConfig, slot_mask
from lopd_jax.method.losses_kl import chunked_token_logp
from lopd_jax.method.splice import SpliceLayout, teacher_hidden_states
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import StepConfig
from models.config import LoraConfig, named_config
from models.decoder import Decoder
from train.steps import grad_shares, lopd_grads, lopd_loss
from train.system import LOPDSystem


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    """Build a system, time the three functions, print the ratios."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_margin_metrics", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_qwen3")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--exp_len", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    comp = ComposerConfig(num_latents=4, depth=2, n_ret=2, lora=LoraConfig(rank=8, alpha=16.0))
    layout = SpliceLayout(before_ids=(11, 12, 13), after_ids=(14, 15), num_slots=comp.n_ret * comp.num_latents,
                          slot_id=7)
    system = LOPDSystem.create(Decoder(named_config(args.model, lora=comp.lora), rngs=nnx.Rngs(0)), comp, layout,
                               StepConfig(loss=LossConfig(logits_chunk=128, top_m=20)))
    state, frozen = system.init_state()
    state = dict(state, beta=jnp.float32(0.5))
    rng = np.random.RandomState(0)
    B, S, L = args.batch, args.seq, args.exp_len
    vocab = system.model_cfg.vocab_size
    batch = {"tokens": jnp.asarray(rng.randint(16, vocab, (B, S)), jnp.int32),
             "attention_mask": jnp.ones((B, S), bool), "insert_at": jnp.full((B,), 4, jnp.int32),
             "loss_mask": jnp.asarray(np.arange(S)[None] >= S // 4, jnp.float32).repeat(B, 0),
             "exp_tokens": jnp.asarray(rng.randint(16, vocab, (B, comp.n_ret, L)), jnp.int32),
             "exp_mask": jnp.ones((B, comp.n_ret, L), bool), "rewards": jnp.asarray(rng.rand(B), jnp.float32)}
    key = jax.random.key(0)
    fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, batch, key)  # noqa: E731

    base = jax.jit(lambda sp, cp: jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(sp, cp)[1])

    def with_shares(sp, cp):
        _, grads, per_term = lopd_grads(fn, sp, cp, True)
        return grads, grad_shares(grads[1], per_term)

    def plain(cp):
        teacher = system.backbone(frozen, cp["lora"])
        lat = system.latents(frozen, cp, batch["exp_tokens"], batch["exp_mask"])
        h = teacher_hidden_states(teacher, batch["tokens"], batch["attention_mask"], batch["insert_at"], lat, layout,
                                  slot_mask(jnp.zeros_like(batch["exp_mask"]), comp.num_latents))
        return chunked_token_logp(h[:, :-1], teacher.lm_head_kernel(), batch["tokens"][:, 1:], chunk_size=128)

    t_base = _time(base, state["student"], state["composer"], reps=args.reps)
    t_shares = _time(jax.jit(with_shares), state["student"], state["composer"], reps=args.reps)
    t_plain = _time(jax.jit(plain), state["composer"], reps=args.reps)
    print(f"device {jax.devices()[0].platform}, model {args.model}, batch {B} x {S}")
    for name, t in (("value_and_grad (baseline)", t_base), ("lopd_grads + shares", t_shares),
                    ("plain-teacher forward (inside both)", t_plain)):
        print(f"{name:38s} {1e3 * t:9.2f} ms  x{t / t_base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
