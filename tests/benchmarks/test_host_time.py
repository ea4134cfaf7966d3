"""benchmarks/host_time.py at tiny sizes: the stubbed engine run makes exactly the drawn
episodes' tokens through the real scheduler and loop, the profile names no stub function, and
the whole benchmark prints its last line (the device estimates need libtpu)."""

import re

import pytest

from benchmarks.host_time import engine_host, main, top_costs
from configs import load_config
from lopd_jax.planning.engine_schedule import draw_episodes
from lopd_jax.settings.overrides import apply_overrides

LAST = (r"host time: engine \d+\.\d\d ms per chunk = \d+\.\d% of device, "
        r"trainer \d+\.\d\d s per step = \d+\.\d% of device")


def test_stubbed_engine_generates_the_drawn_turns_and_profiles_host_code_only():
    cfg = apply_overrides(load_config("qwen3_8b"), ["engine.slots=4", "engine.num_pages=300"])
    run = engine_host(cfg, 6, seed=1, profile=True)
    caps = cfg.rollout.caps
    eps = draw_episodes(cfg.lengths, 6, caps.max_env_steps, caps.max_turn_tokens, caps.max_total_tokens, seed=1)
    assert run["tokens"] == sum(sum(ep.turns) for ep in eps)  # every turn ended where it was drawn to
    assert run["chunks"] == len(run["live_rows"]) > 0 and run["host_s"] > 0
    assert run["live_rows"].max() <= 4
    costs = top_costs(run["profile"])
    assert len(costs) == 5 and not any("host_time.py" in name for name, _, _ in costs)


def test_prints_the_last_line(capsys):
    pytest.importorskip("libtpu")
    assert main(["--episodes", "3", "--steps", "1", "--bank", "20", "engine.slots=4", "engine.num_pages=300",
                 "env.tasks_per_step=16"]) == 0
    assert re.fullmatch(LAST, capsys.readouterr().out.splitlines()[-1])
