"""Hugging Face import / export round trips, errors, PEFT adapters, sharded import, gs://."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import from_pretrained, load_peft_adapter, save_peft_adapter, save_pretrained
from models.config import LoraConfig
from models.hf_config import UnsupportedConfigError
from models.hf_import import CheckpointMismatchError
from models.lora import LoRAParam
from models.storage import KvStoreStorage, LocalStorage, StorageError, open_storage, parse_gcs_url

TOL = 1e-4
B, S, V = 2, 11, 96


def _ids_mask(batch=B):
    ids = np.random.RandomState(1).randint(0, V, (batch, S))
    mask = np.ones((batch, S), bool)
    mask[1, 7:] = False
    return ids, mask


def _hf_logits(hm, ids, mask):
    with torch.no_grad():
        return hm(torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64))).logits.float().numpy()


def _ours(model, ids, mask, **kw):
    return np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), **kw))


def _maxerr(a, b, mask):
    return float(np.abs(a - b)[mask].max())


def _random_lora_b(model, seed=2, scale=0.05):
    """Every LoRA B drawn from N(0, scale), so the adapter changes the output."""
    rng = np.random.RandomState(seed)
    for t in model.cfg.lora.targets:
        b = getattr(model, f"lora_{t}_b")
        b.set_value(jnp.asarray(rng.normal(0, scale, b.shape).astype(np.float32)))


def _make(tmp, family):
    torch.manual_seed(0)
    if family == "qwen3":
        hc = transformers.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      rope_theta=1e6, max_position_embeddings=128)
        hm = transformers.Qwen3ForCausalLM(hc)
    else:
        hc = transformers.Olmo3Config(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, sliding_window=4, rms_norm_eps=1e-6, max_position_embeddings=128,
            pad_token_id=0, eos_token_id=1,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                             "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0,
                                                "original_max_position_embeddings": 16}})
        hm = transformers.Olmo3ForCausalLM(hc)
    hm.eval()
    with torch.no_grad():
        for p in hm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = str(tmp / family)
    hm.save_pretrained(path)
    return hm, path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_io")
    ids, mask = _ids_mask()
    out = {}
    for fam in ("qwen3", "olmo3"):
        hm, path = _make(tmp, fam)
        out[fam] = (path, _hf_logits(hm, ids, mask))
    return out


@pytest.fixture(scope="module")
def qwen(ckpts):
    """The imported fp32 Qwen3 model (shared) and its logits."""
    model = from_pretrained(ckpts["qwen3"][0])
    ids, mask = _ids_mask()
    return model, _ours(model, ids, mask)


def _params(model):
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.iter_graph(model)
            if isinstance(v, (nnx.Param, LoRAParam))}


@pytest.mark.parametrize("family", ["qwen3", "olmo3"])
def test_import_export_transformers_roundtrip(ckpts, tmp_path, family):
    path, ref = ckpts[family]
    ids, mask = _ids_mask()
    model = from_pretrained(path)
    ours = _ours(model, ids, mask)
    assert _maxerr(ours, ref, mask) <= TOL
    out = tmp_path / "export"
    files = save_pretrained(model, out, dtype="float32", max_shard_size="40KB")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    hm = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hm).__name__ == {"qwen3": "Qwen3ForCausalLM", "olmo3": "Olmo3ForCausalLM"}[family]
    assert _maxerr(_hf_logits(hm, ids, mask), ours, mask) <= TOL


def test_export_import_bitwise_and_sharded_index(qwen, tmp_path):
    model, _ = qwen
    out = tmp_path / "rt"
    save_pretrained(model, out, dtype="float32", max_shard_size=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" in index["weight_map"]
    back = from_pretrained(out)
    a, b = _params(model), _params(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_bf16_export_and_tied(ckpts, tmp_path):
    """bf16 files read back as the bf16 rounding of the fp32 weights; tied export drops lm_head."""
    model = from_pretrained(ckpts["qwen3"][0], tie_word_embeddings=True)
    out = tmp_path / "bf16"
    save_pretrained(model, out, dtype="bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    names = LocalStorage(out).list_tensors("model.safetensors")
    assert "lm_head.weight" not in names and names["model.embed_tokens.weight"].dtype == "BF16"
    back = from_pretrained(out)
    src, got = _params(model), _params(back)
    for k in src:
        want = src[k].astype(jnp.bfloat16).astype(np.float32)
        assert np.array_equal(got[k], want), k


# ----- errors name the problem -----

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    f = os.path.join(path, "model.safetensors")
    tensors = safetensors.numpy.load_file(f)
    edit(tensors)
    safetensors.numpy.save_file(tensors, f, metadata={"format": "pt"})


def _edit_config(path, edit):
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    edit(cfg)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


def test_tensor_errors_list_names(ckpts, tmp_path):
    path = _copy(ckpts["qwen3"][0], tmp_path / "bad")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((5, 32), np.float32)
        t["model.norm.weight"] = np.zeros(32, np.int32)

    _edit_tensors(path, edit)
    with pytest.raises(CheckpointMismatchError) as e:
        from_pretrained(path)
    msg = str(e.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors: model.layers.0.extra.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight [5, 32] (expected [24, 32])" in msg
    assert "model.norm.weight (I32)" in msg


@pytest.mark.parametrize("edit, field, exc", [
    (lambda c: c.update(architectures=["MistralForCausalLM"]), "architectures", UnsupportedConfigError),
    (lambda c: c.update(attention_bias=True), "attention_bias", UnsupportedConfigError),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act", UnsupportedConfigError),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type",
     UnsupportedConfigError),
    (lambda c: c.pop("hidden_size"), "hidden_size", UnsupportedConfigError),
])
def test_config_errors_name_field(ckpts, tmp_path, edit, field, exc):
    path = _copy(ckpts["qwen3"][0], tmp_path / "cfg")
    _edit_config(path, edit)
    with pytest.raises(exc, match=field):
        from_pretrained(path)


def test_missing_files(ckpts, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(empty)
    path = _copy(ckpts["qwen3"][0], tmp_path / "nofile")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        from_pretrained(path)


# ----- LoRA: PEFT adapter and merged export -----

def test_peft_adapter_and_merged_export(ckpts, tmp_path):
    from peft import PeftModel

    path = ckpts["olmo3"][0]
    ids, mask = _ids_mask()
    model = from_pretrained(path, lora=LoraConfig(rank=4, alpha=8.0))
    _random_lora_b(model)
    before = _params(model)
    ours_lora = _ours(model, ids, mask, lora=True)
    ours_base = _ours(model, ids, mask)
    assert _maxerr(ours_lora, ours_base, mask) > 1e-3  # the adapter does something

    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(path))
    hm = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    pm = PeftModel.from_pretrained(hm, str(tmp_path / "adapter")).eval()
    assert _maxerr(_hf_logits(pm, ids, mask), ours_lora, mask) <= TOL

    fresh = from_pretrained(path, lora=LoraConfig(rank=4, alpha=8.0), lora_seed=7)
    load_peft_adapter(fresh, tmp_path / "adapter")
    got = _params(fresh)
    assert all(np.array_equal(got[k], before[k]) for k in before), "PEFT adapter round trip"
    with pytest.raises(ValueError, match="r: adapter 4 vs model 2"):
        load_peft_adapter(from_pretrained(path, lora=LoraConfig(rank=2, alpha=8.0)), tmp_path / "adapter")

    save_pretrained(model, tmp_path / "merged", dtype="float32", merge_lora=True)
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert _maxerr(_hf_logits(merged_hf, ids, mask), ours_lora, mask) <= TOL
    after = _params(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # caller's model untouched


# ----- sharded import on a simulated mesh -----

def test_sharded_import_matches_single_device(ckpts, qwen):
    single, _ = qwen
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = from_pretrained(ckpts["qwen3"][0], mesh=mesh)
    expected = {
        "embed": P("tensor", "fsdp"),
        "q": P(None, "fsdp", "tensor", None),
        "k": P(None, "fsdp", "tensor", None),
        "o": P(None, "tensor", None, "fsdp"),
        "gate": P(None, "fsdp", "tensor"),
        "down": P(None, "tensor", "fsdp"),
        "lm_head": P("fsdp", "tensor"),
        "q_norm": P(None, None),
    }
    for name, spec in expected.items():
        arr = getattr(model, name)[...]
        assert arr.sharding.mesh.shape == mesh.shape and arr.sharding.spec == spec, (name, arr.sharding.spec)
        assert np.array_equal(np.asarray(arr), np.asarray(getattr(single, name)[...])), name
    ids, mask = _ids_mask(batch=4)
    mask[3, 5:] = False
    got = _ours(model, ids, mask)
    want = _ours(single, ids, mask)
    assert _maxerr(got, want, mask) <= 1e-5


# ----- storage: gs:// parsing and errors, ranged reads through tensorstore -----

def test_gcs_url_parsing_and_errors():
    assert parse_gcs_url("gs://bkt/a/b/") == ("bkt", "a/b/")
    assert parse_gcs_url("gs://bkt") == ("bkt", "")
    with pytest.raises(ValueError, match="no bucket"):
        parse_gcs_url("gs:///x")
    with pytest.raises(ValueError, match="gs://"):
        open_storage("s3://bucket/x")
    store = open_storage("gs://lopd-jax-no-such-bucket-for-tests/ckpt", gcs_retries=0)
    assert isinstance(store, KvStoreStorage) and store.spec["bucket"] == "lopd-jax-no-such-bucket-for-tests"
    with pytest.raises(StorageError, match="gs://lopd-jax-no-such-bucket-for-tests/ckpt/config.json"):
        store.read_json("config.json")


def test_kvstore_ranged_reads_roundtrip(qwen, tmp_path):
    """The gs:// code path (tensorstore kvstore, ranged reads, bytes writes) on the file driver."""
    model, logits = qwen
    url = f"file://{tmp_path}/kv"
    out = KvStoreStorage({"driver": "file", "path": f"{tmp_path}/kv/"}, url)
    save_pretrained(model, out, dtype="bfloat16", max_shard_size="30KB")
    local = LocalStorage(tmp_path / "kv")
    index = local.read_json("model.safetensors.index.json")
    for fname in sorted(set(index["weight_map"].values()))[:2]:
        ref = safetensors.torch.load_file(str(tmp_path / "kv" / fname))  # the library's own reader
        ranged, loc = out.list_tensors(fname), local.list_tensors(fname)
        assert set(ranged) == set(loc) == set(ref)
        for k, t in ref.items():
            assert ranged[k].dtype == "BF16" and ranged[k].shape == tuple(t.shape)
            want = t.float().numpy()
            assert np.array_equal(out.read_tensor(ranged[k]).astype(np.float32), want), k
            assert np.array_equal(local.read_tensor(loc[k]).astype(np.float32), want), k
    back = from_pretrained(out)
    ids, mask = _ids_mask()
    assert _maxerr(_ours(back, ids, mask), logits, mask) < 0.1  # bf16-rounded weights
