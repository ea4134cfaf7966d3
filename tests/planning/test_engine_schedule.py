"""The schedule model (lopd_jax/planning/engine_schedule.py) on hand-made episodes whose utilisation
is known, and the rollout's caps on drawn episodes. Pure Python, well under a second."""

from lopd_jax.planning.engine_schedule import Episode, draw_episodes, pool_pages, simulate_engine, simulate_static
from lopd_jax.settings.length_config import LengthConfig


def test_static_waits_for_the_longest_turn_and_the_engine_refills():
    eps = [Episode(10, (3, 2), (5,)), Episode(10, (1,), ())]
    st = simulate_static(eps, rows=2, env_steps=0)
    assert st["useful"] == 6 and st["utilisation"] == 6 / (2 * 3 + 2 * 2)  # turn 1: 3 steps; turn 2: 2
    # engine, 2 slots, one step per chunk, no env latency: both busy for one step, then one
    # idles while episode 0 runs its 3 + 2 tokens alone (5 steps)
    en = simulate_engine(eps, slots=2, in_flight=2, chunk=1, env_steps=0)
    assert en["useful"] == 6 and en["steps"] == 5 and en["utilisation"] == 6 / 10
    # one slot, 2 in flight: the slot never idles
    en1 = simulate_engine(eps, slots=1, in_flight=2, chunk=1, env_steps=0)
    assert en1["utilisation"] == 1.0 and en1["steps"] == 6
    # a chunk of 4: a turn of 1 or 3 still takes the whole chunk
    en4 = simulate_engine(eps, slots=1, in_flight=2, chunk=4, env_steps=0)
    assert en4["steps"] == 12 and en4["utilisation"] == 6 / 12
    # live tokens: both prompts, then episode 0's growing context
    assert en["live_tokens_max"] >= 20


def test_drawn_episodes_respect_the_caps_and_the_pool_rule():
    eps = draw_episodes(LengthConfig(turn_median=3000), 300, max_turns=5, max_turn_tokens=4000,
                        max_total_tokens=12_000, seed=1)
    assert all(1 <= len(e.turns) <= 5 and max(e.turns) <= 4000 and e.total <= 12_000 for e in eps)
    assert all(len(e.obs) == len(e.turns) - 1 for e in eps if e.total < 11_000)
    assert pool_pages(1000.0, 4, 64, 512) == -(-1250 // 64) + 4
    assert pool_pages(10.0, 1, 64, 40_960) == 641  # at least one episode at the cap
