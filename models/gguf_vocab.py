"""The tokenizer stored in a llama.cpp GGUF file, built without PyTorch.

``transformers``' own GGUF reader (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``)
imports PyTorch, which the runtime install leaves out (TPU VMs run JAX only, and a CPU
torch is a large download that nothing else needs). The file's tokenizer is plain data --
vocabulary, merges, token types, special token ids and the chat template -- so
:func:`gguf_tokenizer` reads it with the ``gguf`` package (as :mod:`models.gguf` reads the
tensors) and builds the same byte-level BPE pipeline ``transformers`` builds (its GPT-2
tokenizer: ``BPE`` + ``ByteLevel`` pre-tokenizer and decoder, control tokens added as
special tokens) with ``tokenizers``, wrapped in ``transformers.PreTrainedTokenizerFast``.

Supported: ``tokenizer.ggml.model = gpt2`` (byte-level BPE: SmolLM2, Llama 3, Qwen ...). A
SentencePiece (``llama``) or other tokenizer raises
:class:`models.gguf.UnsupportedGGUFError` naming it and the way on.
"""

from __future__ import annotations

import os
from typing import Any

from models.gguf import UnsupportedGGUFError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# tokenizer.ggml.pre -> the split regex its merges were learned with (None: GPT-2's, ByteLevel's own)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def read_tokenizer_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, keys without the ``tokenizer.`` prefix
    (``ggml.tokens``, ``ggml.merges``, ``ggml.token_type``, ``ggml.bos_token_id``, ``chat_template``...)."""
    try:
        import gguf  # optional: only .gguf files need it
    except ImportError as e:
        raise ImportError("reading a .gguf file needs the `gguf` package: pip install gguf") from e
    reader = gguf.GGUFReader(os.fspath(path))
    return {k[len("tokenizer."):]: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet): printable
    Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_level(tokens: list[str], alphabet: set[str]) -> list[str]:
    """Tokens in the byte-level alphabet (llama.cpp keeps them so; a few files spell some raw)."""
    spelling = _byte_alphabet()
    return [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]


def gguf_tokenizer(path: str | os.PathLike):
    """The ``transformers`` fast tokenizer stored in the GGUF file ``path``: vocabulary,
    merges, control tokens as special tokens, bos / eos / unk / pad and the chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path = os.fspath(path)
    f = read_tokenizer_fields(path)
    kind = f.get("ggml.model")
    if "ggml.tokens" not in f:
        raise UnsupportedGGUFError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens); convert it with "
                                   "--no_tokenizer and give the run a tokenizer (model.tokenizer=...).")
    if kind != "gpt2":
        raise UnsupportedGGUFError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2', byte-level BPE); convert the "
            "original Hugging Face checkpoint instead, or write this file's weights with `python -m "
            "lopd_jax.convert_gguf --no_tokenizer` and copy the model's tokenizer files beside them.")
    alphabet = set(_byte_alphabet().values())
    tokens = _byte_level(list(f["ggml.tokens"]), alphabet)
    merges = [tuple(m.split(" ", 1)) for m in f.get("ggml.merges") or []]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tok = Tokenizer(bpe)
    split = PRE_SPLITS.get(f.get("ggml.pre"))
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), level])
    tok.decoder = decoders.ByteLevel()
    types = list(f.get("ggml.token_type") or [])
    raw = list(f["ggml.tokens"])  # a control token spelled outside the alphabet is mislabelled: skipped
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, r, ty in zip(tokens, raw, types)
                            if ty == CONTROL and set(r) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                    if ty == USER_DEFINED])

    def named(key):
        i = f.get(f"ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = named("bos_token_id")
    if f.get("ggml.add_bos_token") and bos is not None:  # llama.cpp starts every text with BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(f["ggml.bos_token_id"]))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
        chat_template=f.get("chat_template"), clean_up_tokenization_spaces=False)


__all__ = ["gguf_tokenizer", "read_tokenizer_fields"]
