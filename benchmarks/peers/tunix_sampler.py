"""The workload through Tunix's ``tunix.generate.sampler.Sampler`` (``google-tunix``), in
``.venv-peers/tunix``: ``python benchmarks/peers/tunix_sampler.py WEIGHTS WORKLOAD OUT``.

The tiny Qwen3 is loaded with ``tunix.models.qwen3.params.create_model_from_safe_tensors``
under a ``ModelConfig`` read from its config.json. The sampler has no multi-turn episodes,
so each turn is one batched greedy call on the growing prompts (``common.turn_by_turn``),
prompts given as the tokenizer's words; the stop id is one outside the vocabulary, so every
row generates exactly ``new_tokens``. The KV cache holds the longest last-turn prompt
(rounded to a power of two, as the sampler pads it) plus ``new_tokens``.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import common  # noqa: E402 -- this script's own folder (run as a script in the peer's venv)


def setup(weights: str, wl: dict):
    """Load the model and tokenizer, build the sampler; returns ``run(workload)``."""
    import transformers  # noqa: PLC0415 -- after JAX_PLATFORMS is set
    from tunix.generate import sampler as sampler_lib  # noqa: PLC0415
    from tunix.models.qwen3 import model as model_lib, params as params_lib  # noqa: PLC0415

    with open(os.path.join(weights, "config.json")) as f:
        hf = json.load(f)
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])
    model = params_lib.create_model_from_safe_tensors(weights, cfg)
    tok = transformers.AutoTokenizer.from_pretrained(weights)
    longest = max(len(p) for p in wl["prompts"]) + (wl["turns"] - 1) * (wl["new_tokens"] + len(wl["reply"]))
    cache = 1 << (longest - 1).bit_length()
    sampler = sampler_lib.Sampler(model, tok, sampler_lib.CacheConfig(
        cache_size=cache + wl["new_tokens"], num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim))
    never = [hf["vocab_size"]]

    def generate(prompts, new_tokens):
        out = sampler([common.text_of(p) for p in prompts], max_generation_steps=new_tokens,
                      eos_tokens=never, temperature=0.0)
        return out.tokens

    return lambda w: common.turn_by_turn(generate, w)


if __name__ == "__main__":
    raise SystemExit(common.main("tunix", "google-tunix", "a new batched call per turn on the growing prompt",
                                 setup))
