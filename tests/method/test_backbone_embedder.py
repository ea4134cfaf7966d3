"""The Qwen3-Embedding-style backbone embedder on a tiny random decoder."""

import numpy as np
from flax import nnx

from lopd_jax.method.backbone_embedder import BackboneEmbedder
from lopd_jax.chat.tokenizers import hf_tokenizer, tiny_tokenizer
from models.config import named_config
from models.decoder import Decoder


def _embedder(**kw):
    tok = tiny_tokenizer("qwen3")
    cfg = named_config("tiny_qwen3", vocab_size=576)
    return BackboneEmbedder(Decoder(cfg, rngs=nnx.Rngs(0)), tok, **kw), tok


def test_shape_normalization_and_last_token_pooling():
    emb, tok = _embedder()
    texts = ["Book room 101 for Ana.", "Deposit 30 into the savings account of Bo, then report the balance."]
    vecs = emb.embed_documents(texts)
    assert vecs.shape == (2, 64) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, rtol=1e-5)
    # the short text was right-padded in the batch; alone (no padding at all) it gives the same vector
    ids = emb.token_ids(texts[0])
    model = nnx.merge(emb._graphdef, emb._params)
    h = np.asarray(model(np.asarray([ids], np.int32), return_hidden=True))[0, -1]
    np.testing.assert_allclose(vecs[0], h / np.linalg.norm(h), atol=1e-5)
    assert ids[-1] == tok.convert_tokens_to_ids("<|endoftext|>") != tok.eos_token_id  # pooling token, not EOS
    assert not np.allclose(vecs[0], vecs[1])


def test_query_instruction_changes_queries_only():
    emb, _ = _embedder(query_instruction="Find a solved task like this one")
    doc = emb.embed_documents(["Book room 101 for Ana."])
    q = emb.embed_queries(["Book room 101 for Ana."])
    assert not np.allclose(doc, q)
    assert emb.spec()["query_instruction"] == "Find a solved task like this one"


def test_qwen3_embedding_pools_endoftext_151643_like_transformers(tmp_path):
    """The official Qwen3-Embedding recipe: append <|endoftext|> (id 151643, not EOS <|im_end|>)
    and take the final-norm hidden state of that last token. Checked against transformers'
    Qwen3Model of the same tiny random backbone, loaded from the same checkpoint."""
    import torch
    import transformers

    from lopd_jax.chat.tokenizers import qwen3_tokenizer

    tok = qwen3_tokenizer()
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e6,
                                   rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    emb = BackboneEmbedder.from_pretrained(str(tmp_path), hf_tokenizer(str(tmp_path)))
    texts = ["Book room 101 for Ana.", "Deposit 30 into the savings account of Bo, then report the balance."]
    rows = [emb.token_ids(t) for t in texts]
    assert all(r[-1] == 151643 for r in rows) and tok.eos_token_id == 151645
    vecs = emb.embed_documents(texts)
    with torch.no_grad():
        ref = []
        for r in rows:  # one text at a time: no padding in the reference
            h = hf.model(torch.tensor([r])).last_hidden_state[0, -1].double().numpy()
            ref.append(h / np.linalg.norm(h))
    np.testing.assert_allclose(vecs, np.stack(ref), atol=1e-5)
