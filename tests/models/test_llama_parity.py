"""The Llama family on tiny random weights: fp32 parity of models.hf_import.from_pretrained
against transformers LlamaForCausalLM, the Hugging Face export round trip, the PEFT adapter
round trip, the KV-cached decode path, and the config errors of the family.

Models are built here with random weights (norms moved away from 1, so a misplaced or
missing norm shows), saved with transformers' save_pretrained and loaded with our importer.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from models import from_pretrained, load_peft_adapter, save_peft_adapter, save_pretrained
from models.config import LoraConfig, named_config
from models.hf_config import UnsupportedConfigError, from_hf_config, to_hf_config

from tests.models.test_hf_io import _maxerr, _ours, _random_lora_b
from tests.models.test_hf_parity import (V, _build_all, _hf_logits, _ids_mask,  # B, S, V = 2, 13, 128 and
                                         _loaded)  # the right-padded second row

TOL = 1e-4


def _llama(**kw):
    base = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, rope_theta=1e5, rms_norm_eps=1e-5,
                max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return transformers.LlamaConfig(**base)


CASES = {
    "tied_gqa": lambda: _llama(),  # SmolLM2's shape: tied, GQA 3:1, theta 1e5
    "untied_mha_head_dim": lambda: _llama(tie_word_embeddings=False, num_key_value_heads=6, head_dim=12,
                                          rope_theta=10_000.0),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cases = {name: (transformers.LlamaForCausalLM, make) for name, make in CASES.items()}
    return _build_all(tmp_path_factory.mktemp("llama"), cases)


@pytest.mark.parametrize("name", list(CASES))
def test_parity_plain(built, name):
    model, err = _loaded(built, name)
    cfg = model.cfg
    assert cfg.family == "llama" and cfg.qk_norm == "none" and cfg.norm_placement == "pre"
    assert not hasattr(model, "q_norm") and not hasattr(model, "k_norm")
    assert err <= TOL


def test_parity_blockwise_and_config_fields(built):
    model, err = _loaded(built, "tied_gqa", attention_impl="blockwise", attention_block_q=4, attention_block_kv=4)
    assert err <= TOL
    cfg = model.cfg
    assert cfg.rope_by_type["full_attention"].theta == 1e5 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and not hasattr(model, "lm_head")
    assert cfg.head_dim == 8 and cfg.num_kv_heads == 2
    assert from_pretrained(built["untied_mha_head_dim"][0]).cfg.head_dim == 12


def test_cached_decode_matches_full_forward(built):
    """Prefill then one-token steps through the KV cache give the full forward's logits."""
    path, _ = built["tied_gqa"]
    model = from_pretrained(path)
    ids = np.random.RandomState(3).randint(0, V, (2, 10))
    full = _ours(model, ids, np.ones_like(ids, bool))
    cache = model.init_cache(2, 16)
    out, cache = model(jnp.asarray(ids[:, :6]), cache=cache)
    steps = [np.asarray(out)]
    for t in range(6, 10):
        out, cache = model(jnp.asarray(ids[:, t:t + 1]), cache=cache)
        steps.append(np.asarray(out))
    assert np.abs(np.concatenate(steps, axis=1) - full).max() <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_export_roundtrip(built, tmp_path, name):
    path, ref = built[name]
    ids, mask = _ids_mask()
    model = from_pretrained(path)
    save_pretrained(model, tmp_path / "export", dtype="float32")
    with open(tmp_path / "export" / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["LlamaForCausalLM"] and "q_norm" not in str(written)
    hm = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(hm).__name__ == "LlamaForCausalLM"
    assert _maxerr(_hf_logits(hm, ids, mask), ref, mask) <= TOL
    again = from_pretrained(tmp_path / "export")
    assert again.cfg == model.cfg


def test_peft_adapter_roundtrip(built, tmp_path):
    from peft import PeftModel

    path, _ = built["tied_gqa"]
    ids, mask = _ids_mask()
    model = from_pretrained(path, lora=LoraConfig(rank=4, alpha=8.0))
    _random_lora_b(model)
    ours_lora = _ours(model, ids, mask, lora=True)
    assert _maxerr(ours_lora, _ours(model, ids, mask), mask) > 1e-3  # the adapter does something
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=path)
    pm = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(path),
                                   str(tmp_path / "adapter")).eval()
    assert _maxerr(_hf_logits(pm, ids, mask), ours_lora, mask) <= TOL
    fresh = from_pretrained(path, lora=LoraConfig(rank=4, alpha=8.0), lora_seed=5)
    load_peft_adapter(fresh, tmp_path / "adapter")
    assert _maxerr(_ours(fresh, ids, mask, lora=True), ours_lora, mask) == 0.0


def test_named_configs_and_errors():
    smol = named_config("smollm2_135m")
    assert 134_000_000 < smol.num_params() < 135_000_000  # the published 134.5M
    assert from_hf_config(to_hf_config(smol)) == smol
    tiny = named_config("tiny_llama")
    assert tiny.family == "llama" and tiny.qk_norm == "none"
    with pytest.raises(UnsupportedConfigError, match="qk_norm='per_head'.* has no llama"):
        to_hf_config(tiny.replace(qk_norm="per_head"))
    hf = to_hf_config(tiny)
    for field, value in (("attention_bias", True), ("mlp_bias", True), ("pretraining_tp", 2),
                         ("hidden_act", "gelu")):
        with pytest.raises(UnsupportedConfigError, match=f"`{field}`"):
            from_hf_config({**hf, field: value})
    with pytest.raises(UnsupportedConfigError, match="'llama3' is not supported"):
        from_hf_config({**hf, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
