"""The interface of a training-stage arm (:class:`Arm`): everything the stage asks of it.

:class:`train.training_stage.ArmStage` runs every arm's training stage with the same
resumable loop (rollouts, batch, jitted step, records, checkpoints); the arm gives the
rest. What the settings floor knows of an arm (its teacher's context, whether it uses the
composer and the cold start, its group size, its config cross-checks) is its declaration,
:class:`lopd_jax.settings.arm_config.ArmSpec`, here as ``Arm.spec``.
"""

from __future__ import annotations

from typing import Callable

from lopd_jax.settings.arm_config import arm_spec, group_size

SUCCESS = 1.0  # reward of a solved task


class Arm:
    """One training-stage algorithm. A subclass sets :attr:`name` (its registry key and
    module name) and :attr:`step_kind`, and gives :meth:`batch`, :meth:`make_step` and
    :meth:`bucketed_step`; the other methods have defaults that add nothing.

    ``all_rows``: the arm's batch is built from every row of the step (group advantages,
    siblings, a host-side choice from the step's metrics), so every process gathers all
    rollouts and keeps its own rows of the batch; False: each process builds the batch of
    its own rows (LOPD's retrieval is per row).
    """

    name: str = ""
    step_kind: str = ""  # the jitted step family: "lopd", "grpo" or "text" (compile_buckets.STEP_KINDS)
    all_rows: bool = True

    def __init__(self, ctx, bank):
        self.ctx, self.bank = ctx, bank
        self.spec = arm_spec(self.name)
        self.group_size = group_size(ctx.cfg)

    # ----- the state (also without a run context: export, the compile check) -----
    @classmethod
    def add_state(cls, cfg, state):
        """The training state with the entries this arm adds to the LOPD state's layout
        (checkpointed with it); ``state`` may be concrete or abstract (``jax.ShapeDtypeStruct``)."""
        return state

    @classmethod
    def bucketed_step(cls, cfg, system, state) -> Callable:
        """The length-bucketed form of the arm's jitted step (:mod:`train.bucketed_steps`)."""
        raise NotImplementedError

    def shardings(self, state):
        """Shardings of the arm's training state (default: the LOPD state's)."""
        return self.ctx.system.state_shardings(state)

    # ----- one step -----
    def batch(self, step: int, trajs) -> dict:
        """The step batch (numpy) of step ``step``'s trajectories (every row's, or this
        process's, as :attr:`all_rows` says), or its length-bucketed form."""
        raise NotImplementedError

    def make_step(self, state, batch) -> Callable:
        """The jitted ``(state, frozen, batch) -> (state, metrics)`` update for ``batch``."""
        raise NotImplementedError

    def after_step(self, metrics):
        """The step's metrics after the arm has read them (default: unchanged)."""
        return metrics

    # ----- records and checkpoints -----
    def record(self, step: int) -> dict:
        """What the arm adds to step ``step``'s record (default: nothing)."""
        return {}

    def meta(self) -> dict:
        """The arm's own host state for the checkpoint metadata (default: none)."""
        return {}

    def restore(self, meta: dict) -> None:
        """Take the arm's own host state back from a restored checkpoint's metadata."""
