"""A short soak of the rollout engine under environment faults (:mod:`benchmarks.soak_engine`,
whose full run is ``python -m benchmarks.soak_engine``): ~100 multi-turn episodes of the tiny
model on a page pool small enough to preempt, with every fault kind injected (reset / step /
finish / close raising, garbage, huge and forged observations, steps past the timeout, hung
steps, never-ending environments). Nothing escapes, no page or thread leaks, every
environment is closed exactly once, every episode ends as its fault calls for, and ready
work never sits idle behind an environment step for as long as the timeout."""

from benchmarks.soak_engine import FAULTS, soak
from lopd_jax.settings.sections import EngineConfig, RolloutConfig


def test_short_soak_contains_every_fault():
    timeout, lines = 0.5, []
    r = soak(episodes=96, batch=48, timeout=timeout, rss_from=48, log=lines.append,
             engine_config=EngineConfig(slots=2, page_size=32, num_pages=8, decode_chunk=4, prefill_chunk=64,
                                        max_in_flight=6, env_workers=3),
             config=RolloutConfig(max_env_steps=4, max_turn_tokens=8, max_total_tokens=128, max_observation_chars=300))
    assert r["episodes"] == 96 and set(FAULTS) <= set(r["faults"])
    assert r.get("exceptions_escaped", 0) == 0 and r["leaked_pages"] == 0 and r["leaked_threads"] == 0
    assert r.get("bad_closes", 0) == 0 and r.get("bad_outcomes", 0) == 0, "\n".join(lines)
    assert r["env_timeouts"] >= r["faults"]["slow"] + r["faults"]["hang"] > 0
    assert r.get("preemptions", 0) > 0
    assert r.get("max_idle_wait_s", 0.0) < timeout
