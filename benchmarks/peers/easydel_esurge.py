"""The workload through EasyDeL's eSurge engine (``easydel``), in ``.venv-peers/easydel``:
``python benchmarks/peers/easydel_esurge.py WEIGHTS WORKLOAD OUT``.

The tiny Qwen3 is loaded with ``AutoEasyDeLModelForCausalLM.from_pretrained`` (float32)
and served by ``easydel.inference.esurge.eSurge`` with as many sequences as episodes and
a context that holds the last turn. eSurge takes a request per prompt, not an episode of
turns, so each turn is one batched ``generate`` on the growing prompts
(``common.turn_by_turn``), greedy, ``ignore_eos`` with ``min_tokens = max_tokens``, so
every row generates exactly ``new_tokens``. eSurge compiles every batch and token bucket
in its constructor, so there is no untimed warm-up run (on 8 episodes a first run took
20.2 s and the next 18.2 s: the run, not compilation, is the cost on CPU).

On CPU eSurge cannot size its KV page pool: it takes the budget from the devices'
``memory_stats()``, which CPU devices do not report, and falls back to a fixed 4 GiB
(``easydel.caching.ragged_page.cache.per_device_hbm_budget_bytes``); at this model's
head size that pool took the process past 23 GB and the kernel's OOM killer ended it. So
this script replaces that function with a fixed budget of ``KV_BUDGET`` bytes (enough
pages for every episode); nothing else of eSurge is changed.
"""

from __future__ import annotations

import atexit
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import common  # noqa: E402 -- this script's own folder (run as a script in the peer's venv)

KV_BUDGET = 16 << 20


def cap_kv_budget(budget: int) -> None:
    """Make every loaded EasyDeL cache module size its page pool from ``budget`` bytes."""
    import sys  # noqa: PLC0415

    def fixed(util: float = 0.9, mode: str = "free", safety_margin: int = 0) -> int:
        return budget

    for name, mod in list(sys.modules.items()):
        if name.startswith("easydel.") and hasattr(mod, "per_device_hbm_budget_bytes"):
            mod.per_device_hbm_budget_bytes = fixed


def setup(weights: str, wl: dict):
    """Load the model, start eSurge; returns ``run(workload)``."""
    import jax.numpy as jnp  # noqa: PLC0415 -- after JAX_PLATFORMS is set
    from easydel import AutoEasyDeLModelForCausalLM  # noqa: PLC0415
    from easydel.inference import SamplingParams  # noqa: PLC0415
    from easydel.inference.esurge import eSurge  # noqa: PLC0415

    import easydel.caching.ragged_page.cache  # noqa: PLC0415, F401 -- loaded so cap_kv_budget reaches it

    cap_kv_budget(KV_BUDGET)
    model = AutoEasyDeLModelForCausalLM.from_pretrained(weights, dtype=jnp.float32, param_dtype=jnp.float32)
    longest = max(len(p) for p in wl["prompts"]) + wl["turns"] * (wl["new_tokens"] + len(wl["reply"]))
    # twice the longest context: eSurge caps a request's new tokens to keep reserve_tokens free
    engine = eSurge(model=model, tokenizer=weights, dtype=jnp.float32, max_model_len=2 << longest.bit_length(),
                    max_num_seqs=len(wl["prompts"]), page_size=16, silent_mode=True)
    engine.initiate()
    atexit.register(engine.terminate)  # ends its tokenizer and detokenizer worker processes

    def generate(prompts, new_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
        outs = engine.generate([common.text_of(p) for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return lambda w: common.turn_by_turn(generate, w)


if __name__ == "__main__":
    raise SystemExit(common.main("easydel", "easydel", "a new batched generate per turn on the growing prompt",
                                 setup, warmup=False))
