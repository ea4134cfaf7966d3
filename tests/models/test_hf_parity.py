"""fp32 parity of models.hf_import.from_pretrained against transformers Qwen3 / Olmo-3.

Tiny random transformers models are built here, saved with save_pretrained, loaded with
our importer, and compared on a right-padded batch (non-pad positions only).
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models.hf_import import from_pretrained

TOL = 1e-4
B, S, V = 2, 13, 128


def _ids_mask():
    ids = np.random.RandomState(0).randint(0, V, (B, S))
    mask = np.ones((B, S), bool)
    mask[1, 9:] = False  # right padding in the second row
    return ids, mask


def _build(tmp, cls, hf_cfg, name):
    torch.manual_seed(0)
    hm = cls(hf_cfg).eval()
    with torch.no_grad():
        for p in hm.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so a wrong norm shows
    path = str(tmp / name)
    hm.save_pretrained(path)
    return hm, path


def _hf_logits(hm, ids, mask):
    with torch.no_grad():
        return hm(torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64))).logits.float().numpy()


def _err(model, ref, ids, mask):
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert out.shape == ref.shape
    return float(np.abs(out - ref)[mask].max())


def _qwen3(**kw):
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=1e6,
                rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
    base.update(kw)
    return transformers.Qwen3Config(**base)


_OLMO_YARN = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 16,
              "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.2079441541679836}


def _olmo3(**kw):
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                rms_norm_eps=1e-6, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                                 "full_attention": dict(_OLMO_YARN)})
    base.update(kw)
    return transformers.Olmo3Config(**base)


CASES = {
    "qwen3_untied_gqa": (transformers.Qwen3ForCausalLM, lambda: _qwen3()),
    "qwen3_tied_mha": (transformers.Qwen3ForCausalLM,
                       lambda: _qwen3(tie_word_embeddings=True, num_key_value_heads=4, head_dim=8)),
    "qwen3_sliding_yarn": (transformers.Qwen3ForCausalLM, lambda: _qwen3(
        use_sliding_window=True, sliding_window=4, max_window_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 8})),
    "olmo3_sliding_yarn_gqa": (transformers.Olmo3ForCausalLM, lambda: _olmo3()),
    "olmo3_mha": (transformers.Olmo3ForCausalLM, lambda: _olmo3(num_key_value_heads=4)),
}


def _build_all(tmp, cases):
    """``name -> (checkpoint path, transformers' logits)`` for each ``name -> (model class,
    config factory)`` of ``cases``, built by :func:`_build`."""
    ids, mask = _ids_mask()
    out = {}
    for name, (cls, make) in cases.items():
        hm, path = _build(tmp, cls, make(), name)
        out[name] = (path, _hf_logits(hm, ids, mask))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build_all(tmp_path_factory.mktemp("hf_parity"), CASES)


def _loaded(built, name, **kw):
    """``(model, error)``: case ``name`` of ``built`` loaded by us (``from_pretrained(path,
    **kw)``) and its largest logit difference to transformers' on the unpadded positions."""
    path, ref = built[name]
    ids, mask = _ids_mask()
    model = from_pretrained(path, **kw)
    return model, _err(model, ref, ids, mask)


@pytest.mark.parametrize("name", list(CASES))
def test_parity_plain(built, name):
    assert _loaded(built, name)[1] <= TOL


@pytest.mark.parametrize("name", ["qwen3_untied_gqa", "olmo3_sliding_yarn_gqa"])
def test_parity_blockwise(built, name):
    model, err = _loaded(built, name, attention_impl="blockwise", attention_block_q=4, attention_block_kv=4)
    assert model.cfg.attention_impl == "blockwise" and err <= TOL


def test_imported_config_fields(built):
    q = from_pretrained(built["qwen3_sliding_yarn"][0]).cfg
    assert q.layer_types == ("full_attention", "sliding_attention") and q.sliding_window == 4
    assert q.rope_by_type["sliding_attention"].rope_type == "yarn"
    o = from_pretrained(built["olmo3_sliding_yarn_gqa"][0]).cfg
    assert o.family == "olmo3" and o.norm_placement == "post" and o.qk_norm == "full"
    assert o.rope_by_type["full_attention"].rope_type == "yarn"
    assert o.rope_by_type["sliding_attention"].rope_type == "default"


def test_olmo3_old_rope_format_and_switch(tmp_path):
    """Old config.json (rope_theta + rope_scaling): default = what transformers 5.x does
    (YaRN on full layers only); the switch = YaRN on every layer, checked against a
    transformers model configured that way explicitly."""
    ids, mask = _ids_mask()
    _, path = _build(tmp_path, transformers.Olmo3ForCausalLM, _olmo3(), "olmo_old")
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        raw = json.load(f)
    raw.pop("rope_parameters")
    yarn = {k: v for k, v in _OLMO_YARN.items() if k != "rope_theta"}
    raw.update(rope_theta=5e5, rope_scaling=yarn)
    with open(cfg_file, "w") as f:
        json.dump(raw, f)

    hf_default = transformers.Olmo3ForCausalLM.from_pretrained(path).eval()
    assert hf_default.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    ref_default = _hf_logits(hf_default, ids, mask)
    assert _err(from_pretrained(path), ref_default, ids, mask) <= TOL

    every = _olmo3(rope_parameters={"sliding_attention": dict(_OLMO_YARN), "full_attention": dict(_OLMO_YARN)})
    hf_every = transformers.Olmo3ForCausalLM.from_pretrained(path, config=every).eval()
    ref_every = _hf_logits(hf_every, ids, mask)
    assert np.abs(ref_every - ref_default)[mask].max() > 1e-3  # the two semantics really differ
    switched = from_pretrained(path, yarn_on_sliding_layers=True)
    assert switched.cfg.rope_by_type["sliding_attention"].rope_type == "yarn"
    assert _err(switched, ref_every, ids, mask) <= TOL
