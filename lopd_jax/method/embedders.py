"""Text embedders for the experience bank (docs/method.md, "Experience bank").

An :class:`Embedder` maps batches of texts to float32, L2-normalized vectors
``[n, dim]``. Documents and queries have separate entry points because instruction-tuned
retrieval models encode them differently: Qwen3-Embedding prefixes queries with
``"Instruct: {task}\\nQuery:{query}"`` and leaves documents bare. Subclasses implement
only :meth:`Embedder._embed` (raw vectors for already-formatted texts); the base class
applies the query prefix, batching, validation and normalization.

:class:`HashingEmbedder` is a small, deterministic, training-free embedder (signed feature
hashing of words, word bigrams and character n-grams) that serves the tests and the CPU
default. A backbone embedder (Qwen3-Embedding through the project's Qwen3 module with
last-token pooling) subclasses :class:`Embedder` the same way.
"""

from __future__ import annotations

import abc
import hashlib
import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

QWEN3_QUERY_TEMPLATE = "Instruct: {task}\nQuery:{query}"


class Embedder(abc.ABC):
    """Batched text -> unit-vector interface used by :class:`lopd_jax.method.bank.ExperienceBank`.

    Args:
      query_instruction: optional task description; when set, every query is formatted
        with ``query_template`` (Qwen3-Embedding style) before embedding.
      query_template: format string with ``{task}`` and ``{query}`` fields.
      batch_size: how many texts :meth:`_embed` receives per call.

    Subclasses set :attr:`name` (a stable identifier saved with a bank) and :attr:`dim`,
    and implement :meth:`_embed`.
    """

    name: str = "embedder"
    dim: int = 0

    def __init__(self, *, query_instruction: str | None = None,
                 query_template: str = QWEN3_QUERY_TEMPLATE, batch_size: int = 64):
        if batch_size <= 0:
            raise ValueError(f"Embedder batch_size must be positive, got {batch_size}.")
        if query_instruction is not None and (
                "{task}" not in query_template or "{query}" not in query_template):
            raise ValueError(
                f"query_template {query_template!r} must contain both '{{task}}' and "
                "'{query}' fields.")
        self.query_instruction = query_instruction
        self.query_template = query_template
        self.batch_size = batch_size

    @abc.abstractmethod
    def _embed(self, texts: list[str]) -> np.ndarray:
        """Raw (not necessarily normalized) vectors ``[len(texts), dim]`` for ``texts``."""

    def spec(self) -> dict[str, Any]:
        """A JSON-serializable description saved in a bank's manifest (name, dim, ...)."""
        return {"name": self.name, "dim": int(self.dim),
                "query_instruction": self.query_instruction}

    def format_query(self, query: str) -> str:
        """The text actually embedded for ``query`` (with the instruction prefix if set)."""
        if self.query_instruction is None:
            return query
        return self.query_template.format(task=self.query_instruction, query=query)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Embed documents as-is: float32 ``[n, dim]``, each row L2-normalized."""
        return self._embed_batched(_check_texts(texts))

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Embed queries (instruction prefix applied if configured): float32 ``[n, dim]``."""
        return self._embed_batched([self.format_query(t) for t in _check_texts(texts)])

    def _embed_batched(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = texts[start:start + self.batch_size]
            out = np.asarray(self._embed(batch), dtype=np.float32)
            if out.shape != (len(batch), self.dim):
                raise RuntimeError(
                    f"{type(self).__name__}._embed returned shape {out.shape}, expected "
                    f"{(len(batch), self.dim)}.")
            chunks.append(out)
        vecs = np.concatenate(chunks, axis=0)
        if not np.all(np.isfinite(vecs)):
            raise RuntimeError(f"{type(self).__name__} produced non-finite embeddings.")
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        # An all-zero vector (e.g. empty text) stays zero: it matches nothing, not everything.
        return (vecs / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("Embedders take a list of texts, not a single string; wrap it: [text].")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"text {i} is {type(t).__name__}, expected str.")
    return texts


_WORD_RE = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder(Embedder):
    """Deterministic signed feature hashing of words, word bigrams and character n-grams.

    Each text is lower-cased and tokenized into words. Features: every word, every
    adjacent word pair, and every character n-gram (``ngram_range``) of each word padded
    with boundary marks (so "flight" and "flights" share most features). Each feature
    hashes (BLAKE2b, stable across processes) to one of ``dim`` buckets with a hashed
    sign, weighted ``group_weight * (1 + log tf)``; character n-grams of one word share
    that word's weight so long words do not dominate. No training, no vocabulary.

    Args:
      dim: vector size (256..4096 sensible; default 512).
      ngram_range: inclusive (min, max) character n-gram lengths.
      word_weight / bigram_weight / char_weight: relative weight of each feature group.
      **kwargs: passed to :class:`Embedder` (``query_instruction`` etc.).
    """

    name = "hashing-v1"

    def __init__(self, dim: int = 512, *, ngram_range: tuple[int, int] = (3, 5),
                 word_weight: float = 1.0, bigram_weight: float = 0.5,
                 char_weight: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        lo, hi = ngram_range
        if dim < 16:
            raise ValueError(f"HashingEmbedder dim={dim} is too small; use 256..4096.")
        if not 1 <= lo <= hi:
            raise ValueError(f"ngram_range={ngram_range} must satisfy 1 <= min <= max.")
        if min(word_weight, bigram_weight, char_weight) < 0 or not (
                word_weight or bigram_weight or char_weight):
            raise ValueError("HashingEmbedder feature weights must be >= 0, not all zero.")
        self.dim = int(dim)
        self.ngram_range = (int(lo), int(hi))
        self.weights = (float(word_weight), float(bigram_weight), float(char_weight))
        self._cache: dict[str, tuple[int, float]] = {}

    def spec(self) -> dict[str, Any]:
        """Name, dim and every setting that changes the vectors."""
        return {**super().spec(), "ngram_range": list(self.ngram_range),
                "weights": list(self.weights)}

    def _bucket(self, feature: str) -> tuple[int, float]:
        hit = self._cache.get(feature)
        if hit is None:
            h = int.from_bytes(hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest(),
                               "little")
            hit = (h % self.dim, 1.0 if (h >> 63) & 1 else -1.0)
            if len(self._cache) < 1_000_000:
                self._cache[feature] = hit
        return hit

    def _features(self, text: str) -> Counter:
        words = _WORD_RE.findall(text.lower())
        w_word, w_bi, w_char = self.weights
        feats: Counter = Counter()
        lo, hi = self.ngram_range
        for w in words:
            feats["w:" + w] += w_word
            padded = f"<{w}>"
            grams = [padded[i:i + n] for n in range(lo, hi + 1)
                     for i in range(len(padded) - n + 1)]
            if grams:
                share = w_char / math.sqrt(len(grams))
                for g in grams:
                    feats["c:" + g] += share
        for a, b in zip(words, words[1:]):
            feats[f"b:{a} {b}"] += w_bi
        return feats

    def _embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float64)
        for row, text in enumerate(texts):
            for feat, tf in self._features(text).items():
                idx, sign = self._bucket(feat)
                # Sublinear in the (weighted) count: repeated words saturate.
                out[row, idx] += sign * math.log1p(tf)
        return out.astype(np.float32)


def build_embedder(spec: dict[str, Any]) -> Embedder:
    """Rebuild a built-in embedder from :meth:`Embedder.spec` (as saved with a bank).

    Only embedders that need no weights can be rebuilt this way; for backbone embedders
    construct the embedder yourself and pass it to ``ExperienceBank.load``.
    """
    name = spec.get("name")
    if name == HashingEmbedder.name:
        return HashingEmbedder(
            dim=int(spec["dim"]), ngram_range=tuple(spec.get("ngram_range", (3, 5))),
            word_weight=spec.get("weights", [1.0, 0.5, 1.0])[0],
            bigram_weight=spec.get("weights", [1.0, 0.5, 1.0])[1],
            char_weight=spec.get("weights", [1.0, 0.5, 1.0])[2],
            query_instruction=spec.get("query_instruction"))
    raise ValueError(
        f"Cannot rebuild embedder {name!r} from its spec alone (known: "
        f"{HashingEmbedder.name!r}); construct it and pass embedder=... to "
        "ExperienceBank.load.")
