"""``lopd_frozen_composer``: LOPD with phi = phi0, cold-started and never updated (its
declaration implies ``steps.freeze_composer``; docs/baselines.md)."""

from __future__ import annotations

from train.arms.lopd import LOPDArm


class FrozenComposerArm(LOPDArm):
    """LOPD's batch and step; the step leaves the composer as the cold start made it."""

    name = "lopd_frozen_composer"


ARM = FrozenComposerArm
