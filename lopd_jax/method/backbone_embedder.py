"""Qwen3-Embedding-style text embedder on the project's own decoder (docs/method.md, "Experience bank").

A Qwen3-Embedding checkpoint is a Qwen3 backbone whose sentence vector is the final
(post-norm) hidden state of the last real token, L2-normalized; queries carry an
instruction prefix ``"Instruct: {task}\\nQuery:{query}"`` (handled by :class:`Embedder`),
documents are embedded bare. Texts are tokenized, the pooling token appended --
``<|endoftext|>`` (id 151643 in Qwen3's vocabulary), as the official Qwen3-Embedding
pipeline does; not the tokenizer's EOS, which for Qwen3 is ``<|im_end|>`` -- right-padded
to a length bucket and run through one jitted forward per bucket; pooling gathers each
row's last valid position, so padding never changes a vector.

Select it in a run config with ``bank.embedder=backbone bank.embedder_path=DIR``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.method.embedders import Embedder
from lopd_jax.core.shapes import bucket
from lopd_jax.core.text import content_ids
from models import from_pretrained

POOL_TOKEN = "<|endoftext|>"
"""The token Qwen3-Embedding appends before last-token pooling (id 151643 for Qwen3)."""


def last_token_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Hidden state [B, D] at each row's last valid (mask True) position of a right-padded batch."""
    last = jnp.maximum(jnp.sum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def _token_id(tokenizer, token: str) -> int:
    """The single id of ``token`` in ``tokenizer``; a clear error if it has none."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"the embedder's tokenizer has no pooling token {token!r}; set bank.embedder_pool_token "
                         "to a token it has (Qwen3-Embedding: <|endoftext|>) or none.")
    return int(tid)


class BackboneEmbedder(Embedder):
    """Last-token pooled, L2-normalized hidden states of a :class:`models.decoder.Decoder`.

    Args:
      model: the decoder (e.g. loaded from a Qwen3-Embedding checkpoint).
      tokenizer: its ``transformers`` tokenizer.
      max_length: texts are truncated to this many tokens (end-of-text id included).
      name: identifier saved with a bank (include the checkpoint, so banks built with
        another model are refused on load).
      pool_token: the token appended to every text, whose final hidden state is the
        vector (default ``<|endoftext|>``, the official Qwen3-Embedding pipeline's);
        None appends nothing (the text's own last token is pooled).
      **kwargs: :class:`Embedder` options (``query_instruction``, ``batch_size``).
    """

    def __init__(self, model, tokenizer, *, max_length: int = 512, name: str = "backbone",
                 pool_token: str | None = POOL_TOKEN, **kwargs: Any):
        super().__init__(**kwargs)
        if max_length < 2:
            raise ValueError(f"BackboneEmbedder max_length={max_length} must be >= 2.")
        self.name = str(name)
        self.dim = int(model.cfg.hidden_size)
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.pool_token = pool_token
        self.pool_id = None if pool_token is None else _token_id(tokenizer, pool_token)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._graphdef, self._params = nnx.split(model)

        def forward(params, ids, mask):
            m = nnx.merge(self._graphdef, params)
            return last_token_pool(m(ids, attention_mask=mask, return_hidden=True), mask).astype(jnp.float32)

        self._forward = jax.jit(forward)

    @classmethod
    def from_pretrained(cls, path: str, tokenizer, **kwargs: Any) -> "BackboneEmbedder":
        """Load a Qwen3-Embedding (or any Qwen3 / Olmo-3) checkpoint; ``tokenizer`` is its
        tokenizer (:func:`lopd_jax.chat.tokenizers.hf_tokenizer` of the same path)."""
        model = from_pretrained(path, dtype=kwargs.pop("dtype", "float32"))
        return cls(model, tokenizer, name=kwargs.pop("name", f"backbone:{path}"), **kwargs)

    def spec(self) -> dict[str, Any]:
        """Name, dim and the settings that change the vectors."""
        return {**super().spec(), "max_length": self.max_length, "pool_token": self.pool_token}

    def token_ids(self, text: str) -> list[int]:
        """The ids embedded for ``text`` (truncated, the pooling token appended)."""
        ids = content_ids(self.tokenizer, text)  # content: control strings stay text
        if self.pool_id is not None:
            ids = ids[: self.max_length - 1] + [self.pool_id]
        return ids[: self.max_length] or [self.pad_id]

    def _embed(self, texts: list[str]) -> np.ndarray:
        rows = [self.token_ids(t) for t in texts]
        S = bucket(max(len(r) for r in rows), (), 16)
        ids = np.full((len(rows), S), self.pad_id, np.int32)
        mask = np.zeros((len(rows), S), bool)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = True
        return np.asarray(self._forward(self._params, jnp.asarray(ids), jnp.asarray(mask)))
