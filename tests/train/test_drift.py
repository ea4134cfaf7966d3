"""The drifting synthetic miniature: the hidden map changes at stated LOPD steps, tasks and
rewards follow the map in force, the bank keeps the old successes."""

import dataclasses
import types

import pytest

from lopd_jax.core.types import AssistantTurn
from lopd_jax.envs.synthetic.domains import CUSTOMERS, HUBS
from lopd_jax.envs.synthetic.drift import DriftSchedule
from lopd_jax.envs.synthetic.env import SyntheticTaskSource, oracle_calls, oracle_hint, oracle_turns
from lopd_jax.method.bank import Experience, ExperienceBank
from lopd_jax.method.embedders import HashingEmbedder
from lopd_jax.settings.schedule_scale import PAPER_LOPD_STEPS

FAM = "dispatch.ship"


def _source(**kw):
    return SyntheticTaskSource(n_train_per_family=32, n_heldout_per_family=16, seed=kw.pop("seed", 0),
                               families=["dispatch"], tool_descriptions=False, **kw)


def _changed(a, b):
    return {c for c in CUSTOMERS if a[c] != b[c]}


def _reward(source, task, turns):
    env = source.make_env()
    env.reset(task)
    for turn in turns:
        result = env.step(turn)
        if result.done:
            return result.reward
    raise AssertionError("episode did not end")


@pytest.mark.parametrize("kw,drifts", [({"drift_steps": (3, 7)}, {3, 7}), ({"drift_every": 4}, {4, 8, 12, 16})])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_map_drifts_exactly_at_the_stated_steps_and_fraction(kw, drifts, fraction):
    source = _source(drift_fraction=fraction, **kw)
    assert source.hidden_rule_at(FAM, 0) == source.hidden_rule(FAM)
    n_moved = round(fraction * len(CUSTOMERS))
    for s in range(1, 18):
        before, now = source.hidden_rule_at(FAM, s - 1), source.hidden_rule_at(FAM, s)
        assert set(now.values()) <= set(HUBS)
        assert len(_changed(before, now)) == (n_moved if s in drifts else 0), s


def test_map_is_deterministic_in_seed_and_drift_index():
    a, b = _source(drift_steps=[2, 5]), _source(drift_steps=[2, 5])
    assert [a.hidden_rule_at(FAM, s) for s in range(8)] == [b.hidden_rule_at(FAM, s) for s in range(8)]
    # the drift index alone decides the map: drift k is the same whichever step it falls on
    c = _source(drift_every=3)
    assert c.hidden_rule_at(FAM, 3) == a.hidden_rule_at(FAM, 2) and c.hidden_rule_at(FAM, 6) == a.hidden_rule_at(FAM, 5)
    other = _source(seed=1, drift_steps=[2, 5])
    assert [other.hidden_rule_at(FAM, s) for s in range(8)] != [a.hidden_rule_at(FAM, s) for s in range(8)]


def test_without_drift_tasks_are_untouched():
    source = _source()
    tasks = source.tasks("train")
    assert source.at_step(tasks, 100) == tasks
    assert all(x is y for x, y in zip(source.at_step(tasks, 100), tasks))


def test_episode_reward_follows_the_map_in_force():
    source = _source(drift_steps=[4], drift_fraction=0.5)
    old_map, new_map = source.hidden_rule_at(FAM, 3), source.hidden_rule_at(FAM, 4)
    moved = _changed(old_map, new_map)
    for split in ("train", "heldout"):
        tasks = source.tasks(split)
        assert [t.payload["params"]["hub"] for t in tasks] == [old_map[t.payload["params"]["customer"]] for t in tasks]
        assert source.at_step(tasks, 3) == [dataclasses.replace(t, payload={**t.payload, "drift_index": 0})
                                            for t in tasks]
        after = source.at_step(tasks, 4)
        n_moved = 0
        for old, new in zip(tasks, after):
            customer = new.payload["params"]["customer"]
            assert (new.task_id, new.instruction) == (old.task_id, old.instruction)
            assert new.payload["params"]["hub"] == new_map[customer]
            assert _reward(source, new, oracle_turns(new)) == 1.0
            stale = _reward(source, new, oracle_turns(old))  # the old map's solution
            assert stale == (0.0 if customer in moved else 1.0), (new.task_id, stale)
            n_moved += customer in moved
        assert n_moved > 0
    assert tasks[0].payload["params"]["hub"] == old_map[tasks[0].payload["params"]["customer"]]  # not mutated


def test_bank_keeps_the_old_successes_so_retrieval_surfaces_stale_hints():
    source = _source(drift_steps=[2], drift_fraction=1.0)
    tasks = source.tasks("train")
    bank = ExperienceBank(HashingEmbedder(dim=256), min_reward=1.0, allow_self_retrieval=True)
    for t in tasks:  # the successes of step 0 (the bank is built before LOPD and frozen)
        msgs = [{"role": "user", "content": t.instruction}, {"role": "assistant", "content": oracle_hint(t)}]
        bank.add(Experience(t.task_id, t.env_id, t.instruction, msgs, 1.0, info={"family": t.family}))
    bank.build()
    entries = list(bank.entries)
    drifted = source.at_step(tasks, 2)
    hits = bank.retrieve([t.instruction for t in drifted], [t.task_id for t in drifted], 1)
    assert list(bank.entries) == entries
    for task, [hit] in zip(drifted, hits):
        assert hit.task_id == task.task_id  # the same instruction's old success
        assert f'"{oracle_calls(task)[0][0].arguments["hub"]}"' not in hit.messages[-1]["content"]
    with pytest.raises(RuntimeError, match="frozen"):
        bank.add(entries[0])


def test_training_stage_asks_the_source_for_the_step():
    from train.data import TaskPipeline
    from train.training_stage import TrainingStage

    source = _source(drift_steps=[1], drift_fraction=1.0)
    stage = TrainingStage.__new__(TrainingStage)
    stage.ctx, stage.group_size = types.SimpleNamespace(source=source), 2
    stage.tasks = iter(TaskPipeline(source.tasks("train"), 4, seed=0, process_index=0, process_count=1))
    for s in range(3):
        rows = stage.step_tasks(s)
        assert len(rows) == 8
        want = source.hidden_rule_at(FAM, s)
        assert all(t.payload["params"]["hub"] == want[t.payload["params"]["customer"]] for t in rows)


def test_drift_settings_are_checked():
    with pytest.raises(ValueError, match="not both"):
        DriftSchedule(every=2, steps=(3,))
    with pytest.raises(ValueError, match="ascending"):
        DriftSchedule(steps=(5, 3))
    with pytest.raises(ValueError, match="drift_fraction"):
        DriftSchedule(steps=(3,), fraction=0.0)
    with pytest.raises(ValueError, match="hidden rule"):
        SyntheticTaskSource(families=["bank"], drift_every=2)


def test_miniature_drift_config_resolves(tmp_path):
    from configs import load_config
    from lopd_jax.envs.registry import get_task_source
    from lopd_jax.programs.train import resolve_config

    base = load_config("miniature")
    cfg = resolve_config(["--config=miniature_drift", f"--workdir={tmp_path}"])
    assert cfg.env.kwargs["drift_steps"] == [8] and cfg.steps == base.steps
    source = get_task_source(cfg.env.source, **cfg.env.kwargs)
    assert source.drift.index(7) == 0 and source.drift.index(8) == 1
    auto = resolve_config(["--config=miniature_drift", f"--workdir={tmp_path}", "stages.schedule_scale=auto"])
    assert auto.steps.eta_beta == pytest.approx(base.steps.eta_beta * PAPER_LOPD_STEPS / cfg.stages.lopd_steps)
    assert auto.steps.composer_lr == pytest.approx(base.steps.composer_lr * PAPER_LOPD_STEPS / cfg.stages.lopd_steps)
