"""Non-finite guard of the train steps (the release skips an optimizer step whose gradient
norm is not finite).

Inside the jitted step, :func:`keep_if_finite` selects, leaf by leaf, the updated state when
every guarded scalar (gradient norms, Delta) is finite and the previous state otherwise; the
step reports ``nonfinite`` (1 = skipped). :class:`NonFiniteTracker` runs on the host: it
counts consecutive skipped steps and raises :class:`NonFiniteError` with what to check once
``steps.max_nonfinite_skips`` is reached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had non-finite gradients; the run stops."""


def all_finite(*scalars) -> jax.Array:
    """True iff every scalar is finite (a bool scalar, traceable)."""
    ok = jnp.asarray(True)
    for x in scalars:
        ok = ok & jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32)))
    return ok


def keep_if_finite(ok: jax.Array, new, old):
    """``new`` where ``ok`` else ``old``, leaf by leaf (same tree structure)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class NonFiniteTracker:
    """Host-side count of skipped steps; raises after ``max_skips`` in a row (0 = never).

    Call :meth:`update` with each step's metrics (reads ``nonfinite``); it returns the
    total number of skipped steps so far.
    """

    def __init__(self, max_skips: int, stage: str = "lopd"):
        self.max_skips = int(max_skips)
        self.stage = stage
        self.consecutive = 0
        self.total = 0

    def update(self, metrics: dict, step: int) -> int:
        """Record one step; raise :class:`NonFiniteError` at ``max_skips`` consecutive skips."""
        skipped = float(metrics.get("nonfinite", 0.0)) > 0
        self.consecutive = self.consecutive + 1 if skipped else 0
        self.total += int(skipped)
        if self.max_skips and self.consecutive >= self.max_skips:
            raise NonFiniteError(
                f"{self.stage} step {step}: {self.consecutive} consecutive steps had a non-finite gradient "
                f"norm or Delta and were skipped (parameters, optimizer state and beta kept). Check the "
                f"rewards and the data for NaN / inf, lower the learning rate, or raise "
                f"steps.max_nonfinite_skips (0 = never stop).")
        return self.total
