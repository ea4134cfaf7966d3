"""Batched greedy decode throughput: train.sampler vs ``transformers`` ``generate`` (CPU).

Both run the same random-weight Qwen3 model (a ~40M-parameter config by default: hidden
512, 8 layers, vocab 32,000, tied embeddings) on the same batch of prompts with different
lengths, greedy, a fixed number of new tokens (no early stop). Our model is loaded from the
saved transformers checkpoint with ``models.from_pretrained``, so the generated ids must
match. Reports generated tokens per second for each (our compile time excluded and shown
separately) and the ratio.

    python benchmarks/bench_decode.py                  # batch 8, 128 new tokens
    python benchmarks/bench_decode.py --batch 4 --new 64 --layers 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from models import from_pretrained  # noqa: E402
from train.sampler import Sampler, SamplingParams  # noqa: E402


def main(argv=None):
    """Run the benchmark and print the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt_min", type=int, default=24)
    p.add_argument("--prompt_max", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=1e6,
                                  max_position_embeddings=4096, tie_word_embeddings=True)
    hm = transformers.Qwen3ForCausalLM(hc).eval()
    with torch.no_grad():
        for w in hm.parameters():
            w.add_(torch.randn_like(w) * 0.02)
    n_params = sum(w.numel() for w in hm.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        hm.save_pretrained(tmp)
        model = from_pretrained(tmp)

    rng = np.random.RandomState(0)
    lens = rng.randint(args.prompt_min, args.prompt_max + 1, args.batch)
    prompts = [rng.randint(0, args.vocab, n).tolist() for n in lens]
    total = args.batch * args.new

    sampler = Sampler(model, stop_ids=(), sampling=SamplingParams(temperature=0.0))
    params = Sampler.params_of(model)
    t0 = time.perf_counter()
    gen = sampler.generate(params, prompts, args.new, jax.random.key(0))
    first = time.perf_counter() - t0
    # transformers: left-padded batch, greedy, exactly `new` tokens
    P = int(lens.max())
    ids = torch.zeros((args.batch, P), dtype=torch.long)
    mask = torch.zeros((args.batch, P), dtype=torch.long)
    for b, pr in enumerate(prompts):
        ids[b, P - len(pr):] = torch.tensor(pr)
        mask[b, P - len(pr):] = 1
    # alternate the two so a change in machine load hits both; keep the best of each
    ours, hf = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        gen = sampler.generate(params, prompts, args.new, jax.random.key(r))
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hm.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=args.new,
                              min_new_tokens=args.new, eos_token_id=None, pad_token_id=0)
        hf.append(time.perf_counter() - t0)
    ours_s, hf_s = min(ours), min(hf)
    same = sum(gen.tokens[b].tolist() == out[b, P:].tolist() for b in range(args.batch))

    print(f"model: {n_params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}); "
          f"batch {args.batch}, prompts {lens.min()}-{lens.max()} tokens, {args.new} new tokens; "
          f"torch threads {torch.get_num_threads()}")
    print(f"train.sampler : {total / ours_s:8.1f} tok/s  ({ours_s:.2f} s; first call incl. compile {first:.2f} s)")
    print(f"hf generate   : {total / hf_s:8.1f} tok/s  ({hf_s:.2f} s)")
    print(f"ratio (ours / transformers): {hf_s / ours_s:.2f}x; identical greedy sequences: {same}/{args.batch}")
    print(f"all runs (s): ours {[round(x, 2) for x in ours]}, transformers {[round(x, 2) for x in hf]}")


if __name__ == "__main__":
    main()
