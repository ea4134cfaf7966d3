"""The arm registry: the settings' declarations (:data:`lopd_jax.settings.arm_config.ARM_SPECS`)
and the training modules (``train/arms/<name>.py``) list the same arms and agree; an
unregistered arm is a ConfigError that lists the registered arms everywhere it is named."""

import os
import types

import jax
import jax.numpy as jnp
import pytest

from configs import load_config
from lopd_jax.settings.arm_config import ARM_SPECS, ARMS, arm_spec, resolve_arm, uses_composer
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.overrides import apply_overrides
from tests.paths import ROOT
from train.arms.base import Arm
from train.arms.registry import arm_class, arm_classes
from train.arms.text import TextArm

NOT_ARMS = {"__init__", "base", "registry", "text"}  # the package's shared modules
STEP_OF_TEACHER = {"latents": "lopd", "text": "text", "none": "grpo"}


def test_both_registries_list_the_same_arms():
    modules = {f[:-3] for f in os.listdir(os.path.join(ROOT, "train", "arms")) if f.endswith(".py")} - NOT_ARMS
    assert modules == set(ARMS) == set(arm_classes())
    for name, cls in arm_classes().items():
        assert issubclass(cls, Arm) and cls.name == name


@pytest.mark.parametrize("name", ARMS)
def test_declaration_and_behaviour_agree(name):
    spec, cls = arm_spec(name), arm_class(name)
    assert cls.step_kind == STEP_OF_TEACHER[spec.teacher]
    assert issubclass(cls, TextArm) == (spec.teacher == "text")
    if spec.teacher == "text":  # framed sentences around the text, as every text arm's block
        assert all(cls.framing) and cls.framing != TextArm.framing
    assert cls.all_rows == (not spec.composer)  # LOPD builds each process's rows; the others every row


def test_unknown_arm_is_a_config_error_listing_the_registered_arms():
    from lopd_jax.programs.compile_buckets import stage_steps
    base = load_config("tiny")
    with pytest.raises(ConfigError, match="grpo"):
        apply_overrides(base, ["arm=ppo"])
    for call in (lambda: arm_spec("ppo"), lambda: arm_class("ppo"),
                 lambda: stage_steps(types.SimpleNamespace(arm="ppo", stages=base.stages))):
        with pytest.raises(ConfigError) as e:
            call()
        assert all(name in str(e.value) for name in ARMS)


def test_the_state_an_arm_adds_is_the_checkpoint_layout():
    """Abstract and concrete alike: only SDFT adds ``ema`` (the student's layout), so every
    other arm's checkpoint is the LOPD state's layout."""
    cfg = load_config("tiny")
    state = {"student": {"w": jnp.ones((2, 3))}, "composer": {"c": jnp.zeros(2)}, "step": jnp.zeros((), jnp.int32)}
    abstract = jax.eval_shape(lambda s: s, state)
    for name, cls in arm_classes().items():
        for s in (state, abstract):
            out = cls.add_state(cfg, s)
            extra = set(out) - set(s)
            assert extra == ({"ema"} if name == "sdft" else set()), name
            if extra:
                assert jax.tree.map(lambda x: (x.shape, x.dtype), out["ema"]) == \
                    jax.tree.map(lambda x: (x.shape, x.dtype), s["student"])


def test_resolve_applies_what_the_arm_implies():
    base = load_config("tiny")
    frozen = resolve_arm(apply_overrides(base, ["arm=lopd_frozen_composer"]))
    assert frozen.steps.freeze_composer and resolve_arm(frozen) == frozen
    assert resolve_arm(base) == base and not base.steps.freeze_composer
    assert [n for n in ARMS if uses_composer(apply_overrides(base, [f"arm={n}"]))] == \
        [n for n, s in ARM_SPECS.items() if s.teacher == "latents"]
    with pytest.raises(ConfigError, match="grpo_epochs=1"):
        apply_overrides(base, ["arm=grpo", "arms.grpo_epochs=2", "steps.is_correction=tis"])
