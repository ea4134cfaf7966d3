"""phi's update-to-weight ratio per AdamW step, with phi kept in float32 and in bfloat16.

    python -m benchmarks.composer_precision [--workdir=data/demo/start] [--lr=1e-5] [--steps=5]
    python -m benchmarks.composer_precision --moved=RUN_DIR [RUN_DIR ...]

Loads the composer phi of a run's cold-start checkpoint (the shipped miniature starting
point by default) and takes ``--steps`` steps of the composer's own optimizer on its
compressor (the part the release casts to bfloat16; the encoder LoRA stays float32 there,
as here) (:func:`train.system.adamw`: global-norm clip, then AdamW with the config's
weight decay) at ``--lr`` (the paper's 1e-5 by default), once with phi and the optimizer
state in float32 (this project) and once in bfloat16 (what a module cast to bfloat16 before
its torch AdamW step does: parameters, moments and the sum ``w + u`` all in bfloat16).

The gradients are a stand-in: i.i.d. Gaussian, fresh each step. AdamW's step is about lr
per element whatever the gradient's scale or direction (m / sqrt(v) is about +-1 in the
first steps), so the update-to-weight ratio depends on lr and phi's weights, which are the
run's. Printed per step and dtype: ``||delta phi|| / ||phi||`` of the step actually applied,
the same for the step AdamW asked for, and the share of elements whose non-zero update
rounds away (``w + u == w`` in the stored dtype). docs/release_parity.md has the numbers.

``--moved=RUN_DIR ...`` prints, for each finished LOPD run, how far its training stage moved
phi: ``||phi_lopd - phi_cold_start|| / ||phi_cold_start||`` (the headroom testbed's rule for
the composer's learning rate, docs/miniature.md section 8).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

DEFAULT_WORKDIR = "data/demo/start"
PAPER_COMPOSER_LR = 1e-5


def load_phi(workdir: str) -> tuple[dict, object]:
    """The composer ``{"lora", "compressor"}`` of the cold-start checkpoint in ``workdir`` (read
    with the run's saved config) and the run's step settings (clip, weight decay)."""
    from lopd_jax.settings.run_config import load_run_config
    from train.run_reader import open_run

    run = open_run(workdir, load_run_config(workdir))
    phi, _, _ = run.composer("cold_start")
    return phi, run.cfg.steps


def moved(run_dir: str) -> float:
    """``||phi_lopd - phi_cold_start|| / ||phi_cold_start||`` of the run in ``run_dir`` (its
    newest LOPD composer checkpoint against the cold start's)."""
    import jax.numpy as jnp

    from lopd_jax.settings.run_config import load_run_config
    from train.run_reader import open_run

    run = open_run(run_dir, load_run_config(run_dir))
    (before, _, _), (after, _, _) = run.composer("cold_start"), run.composer("lopd")
    a, b = _leaves(before), _leaves(after)
    num = sum(float(jnp.sum((y.astype(jnp.float32) - x.astype(jnp.float32)) ** 2)) for x, y in zip(a, b))
    return float(np.sqrt(num / sum(float(jnp.sum(x.astype(jnp.float32) ** 2)) for x in a)))


def _leaves(tree) -> list:
    import jax
    import jax.numpy as jnp

    return [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]


def measure(phi, lr: float, steps: int, dtype, clip: float = 1.0, weight_decay: float = 0.01,
            seed: int = 0) -> list[dict]:
    """Per step: ``applied`` (||delta phi|| / ||phi|| of the step applied in ``dtype``),
    ``asked`` (the same for AdamW's update before it is added) and ``rounded_away`` (share of
    elements with a non-zero update whose stored value did not change)."""
    import jax
    import jax.numpy as jnp

    from train.system import adamw

    params = [x.astype(dtype) for x in _leaves(phi)]
    opt = adamw(lr, clip, weight_decay)
    state = opt.init(params)
    key = jax.random.key(seed)
    out = []
    for t in range(steps):
        key, sub = jax.random.split(key)
        grads = [(1e-3 * jax.random.normal(k, p.shape)).astype(dtype)
                 for k, p in zip(jax.random.split(sub, len(params)), params)]
        upd, state = opt.update(grads, state, params)
        new = [(p + u).astype(dtype) for p, u in zip(params, upd)]  # optax.apply_updates, in the stored dtype
        norm = float(np.sqrt(sum(float(jnp.sum(p.astype(jnp.float32) ** 2)) for p in params)))
        applied = float(np.sqrt(sum(float(jnp.sum((n.astype(jnp.float32) - p.astype(jnp.float32)) ** 2))
                                    for n, p in zip(new, params))))
        asked = float(np.sqrt(sum(float(jnp.sum(u.astype(jnp.float32) ** 2)) for u in upd)))
        moved = sum(int(jnp.sum((u != 0) & (n == p))) for n, p, u in zip(new, params, upd))
        nonzero = sum(int(jnp.sum(u != 0)) for u in upd)
        out.append({"step": t + 1, "applied": applied / norm, "asked": asked / norm,
                    "rounded_away": moved / max(nonzero, 1)})
        params = new
    return out


def main(argv=None) -> int:
    """Print the ratios for float32 and bfloat16."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.composer_precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="a run with a cold-start composer checkpoint")
    p.add_argument("--lr", type=float, default=PAPER_COMPOSER_LR, help="composer learning rate (paper: 1e-5)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--moved", nargs="+", default=None, metavar="RUN_DIR",
                   help="instead: how far each finished LOPD run's training moved phi")
    args = p.parse_args(argv)
    from lopd_jax.io.startup import configure_platform

    configure_platform()  # before JAX is imported: no libtpu noise on CPU
    import jax.numpy as jnp

    if args.moved:
        for run_dir in args.moved:
            print(f"{run_dir}: ||phi_lopd - phi_cold_start|| / ||phi_cold_start|| = {moved(run_dir):.3e}")
        return 0
    phi, steps_cfg = load_phi(args.workdir)
    n, nc = sum(int(x.size) for x in _leaves(phi)), sum(int(x.size) for x in _leaves(phi["compressor"]))
    print(f"phi of {args.workdir} (cold start): {n} parameters, {nc} of them the compressor's (measured); AdamW lr "
          f"{args.lr:g}, clip {steps_cfg.composer_clip}, weight decay {steps_cfg.weight_decay}")
    print("| dtype | step | ||delta phi|| / ||phi|| applied | asked by AdamW | updates rounded away |")
    print("|---|---|---|---|---|")
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        for r in measure(phi["compressor"], args.lr, args.steps, dtype, steps_cfg.composer_clip,
                         steps_cfg.weight_decay):
            print(f"| {name} | {r['step']} | {r['applied']:.3e} | {r['asked']:.3e} | {r['rounded_away']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
