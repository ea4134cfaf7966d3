"""The Qwen3-Embedding-style backbone embedder on a tiny random decoder."""

import numpy as np
from flax import nnx

from lopd_jax.backbone_embedder import BackboneEmbedder
from lopd_jax.tokenizers import tiny_tokenizer
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
    assert ids[-1] == tok.eos_token_id
    assert not np.allclose(vecs[0], vecs[1])


def test_query_instruction_changes_queries_only():
    emb, _ = _embedder(query_instruction="Find a solved task like this one")
    doc = emb.embed_documents(["Book room 101 for Ana."])
    q = emb.embed_queries(["Book room 101 for Ana."])
    assert not np.allclose(doc, q)
    assert emb.spec()["query_instruction"] == "Find a solved task like this one"
