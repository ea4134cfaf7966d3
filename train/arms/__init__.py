"""The training-stage arms: one module per arm, named as the arm (``train/arms/<name>.py``).

:mod:`train.arms.base` is the :class:`train.arms.base.Arm` interface every arm implements,
:mod:`train.arms.text` the shared base of the arms whose teacher reads a text context, and
:mod:`train.arms.registry` looks an arm's class up by the name its declaration has in
:data:`lopd_jax.settings.arm_config.ARM_SPECS`. Every arm runs through the same stage,
:class:`train.training_stage.ArmStage`. Adding an arm: docs/architecture.md.
"""
