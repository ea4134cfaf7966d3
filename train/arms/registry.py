"""The arms' training behaviour by name: ``train/arms/<name>.py`` for every arm declared in
:data:`lopd_jax.settings.arm_config.ARM_SPECS`.

Each arm module defines ``ARM``, its :class:`train.arms.base.Arm` subclass. The lookup goes
through the settings' declaration, so an unknown name is a
:class:`lopd_jax.settings.errors.ConfigError` that lists the registered arms.
"""

from __future__ import annotations

import importlib

from lopd_jax.settings.arm_config import ARMS, arm_spec
from train.arms.base import Arm


def arm_class(name: str) -> type[Arm]:
    """The :class:`train.arms.base.Arm` subclass of arm ``name`` (its module's ``ARM``)."""
    spec = arm_spec(name)
    cls = importlib.import_module(f"train.arms.{spec.name}").ARM
    if cls.name != spec.name:
        raise TypeError(f"train/arms/{spec.name}.py: ARM is {cls.__name__}, named {cls.name!r}, not {spec.name!r}")
    return cls


def arm_classes() -> dict[str, type[Arm]]:
    """Every registered arm's class, in registry order."""
    return {name: arm_class(name) for name in ARMS}


def make_arm(ctx, bank) -> Arm:
    """The arm object of the run ``ctx`` (its ``cfg.arm``) over the frozen experience bank ``bank``."""
    return arm_class(ctx.cfg.arm)(ctx, bank)
