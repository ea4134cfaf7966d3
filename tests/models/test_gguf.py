"""GGUF import on a tiny Llama written here with gguf.GGUFWriter (no download needed).

The file is written the way llama.cpp's converter writes one: q / k rows permuted for its
RoPE, projections block-quantized (Q8_0 / Q4_1; dims are multiples of 32), norms in F32.
Checked: models.gguf undoes the permutation and dequantizes to the values transformers'
own GGUF loader gets; the imported decoder matches transformers on those weights in fp32;
the conversion command writes a checkpoint transformers loads; unsupported architectures
and tensor types fail with errors that name them.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package (pip install gguf)")

from lopd_jax.programs import convert_gguf# noqa: E402
from models import from_pretrained  # noqa: E402
from models.gguf import GGUFStorage, UnsupportedGGUFError, unpermute_qk  # noqa: E402

TOL = 1e-4
V, D, F, L, H, KV = 96, 64, 96, 2, 4, 2
HD = D // H


def _permute(w, n_head):
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                                   num_attention_heads=H, num_key_value_heads=KV, rope_theta=5e4,
                                   rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    hm = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hm


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _write_gguf(path, hm, arch="llama", norm_dtype=np.float32):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(5e4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hm.state_dict().items()}
    Q = gguf.GGMLQuantizationType

    def put(name, arr, qtype):
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", sd["model.norm.weight"], None)
    for i in range(L):
        for hf, g in _NAMES.items():
            a = sd[f"model.layers.{i}.{hf}.weight"]
            if g == "attn_q":
                a = _permute(a, H)
            elif g == "attn_k":
                a = _permute(a, KV)
            qtype = None if a.ndim == 1 else (Q.Q4_1 if i == 0 else Q.Q8_0)
            put(f"blk.{i}.{g}.weight", a.astype(norm_dtype) if a.ndim == 1 else a, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    path = tmp / "tiny-llama.gguf"
    _write_gguf(path, _hf_model())
    # transformers' own GGUF loader: dequantizes and un-permutes independently of ours
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    return path, ref


def _ids_mask():
    ids = np.random.RandomState(0).randint(0, V, (2, 12))
    mask = np.ones((2, 12), bool)
    mask[1, 8:] = False
    return ids, mask


def _hf_logits(hm, ids, mask):
    with torch.no_grad():
        return hm(torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64))).logits.float().numpy()


def test_unpermute_inverts_llama_cpp():
    w = np.random.RandomState(0).normal(size=(KV * HD, 7)).astype(np.float32)
    assert not np.array_equal(_permute(w, KV), w)
    np.testing.assert_array_equal(unpermute_qk(_permute(w, KV), KV), w)


def test_tensors_match_transformers_gguf_loader(tiny):
    path, ref = tiny
    store = GGUFStorage(path)
    assert store.tensor_types() == {"Q8_0": 1 + 7, "Q4_1": 7, "F32": 1 + 2 * L}
    cfg = store.read_json("config.json")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]) == (KV, HD, 5e4)
    infos = store.list_tensors("model.safetensors")
    ref_sd = ref.state_dict()
    assert set(infos) == set(ref_sd) - {"lm_head.weight"}  # tied: transformers aliases the embedding
    for name, info in infos.items():
        np.testing.assert_array_equal(store.read_tensor(info), ref_sd[name].numpy(), err_msg=name)


def test_logits_parity_and_param_dtype(tiny):
    path, ref = tiny
    ids, mask = _ids_mask()
    model = from_pretrained(path)
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert float(np.abs(out - _hf_logits(ref, ids, mask))[mask].max()) <= TOL
    bf = from_pretrained(str(path), dtype="bfloat16")
    assert bf.q[...].dtype == jnp.bfloat16 and bf.cfg.family == "llama"


def test_convert_command_writes_a_transformers_checkpoint(tiny, tmp_path, capsys):
    path, ref = tiny
    out = tmp_path / "hf"
    assert convert_gguf.main([f"--gguf={path}", f"--out={out}"]) == 2  # no tokenizer in this file
    assert "tokenizer" in capsys.readouterr().err.lower()
    assert convert_gguf.main([f"--gguf={path}", f"--out={out}", "--no_tokenizer"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    hm = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids, mask = _ids_mask()
    np.testing.assert_array_equal(_hf_logits(hm, ids, mask), _hf_logits(ref, ids, mask))
    with open(out / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == 2


def test_unsupported_architecture_and_type_named(tmp_path):
    hm = _hf_model()
    _write_gguf(tmp_path / "gpt2.gguf", hm, arch="gpt2")
    with pytest.raises(UnsupportedGGUFError, match="architecture 'gpt2' is not supported"):
        from_pretrained(tmp_path / "gpt2.gguf")
    _write_gguf(tmp_path / "f64.gguf", hm, norm_dtype=np.float64)
    with pytest.raises(UnsupportedGGUFError, match=r"tensor type\(s\) \['F64'\]"):
        GGUFStorage(tmp_path / "f64.gguf")
    assert convert_gguf.main([f"--gguf={tmp_path / 'f64.gguf'}", f"--out={tmp_path / 'o'}"]) == 2
