"""Batched decode throughput: benchmarks.static_sampler vs ``transformers`` ``generate`` (CPU).

The same random-weight Qwen3 (41.6M parameters by default) on both sides, the same batch of
prompts of different lengths, exactly ``--new`` new tokens per row, greedy and sampled with the
method's defaults; one warm-up call per side and mode is excluded, then timed calls alternate and
the ratio is of the medians. Greedy outputs are checked to be identical; tokens/s counts
generated tokens over the whole call (prefill included).

    python -m benchmarks.bench_decode                       # batch 8, 128 new tokens
    python -m benchmarks.bench_decode --batch 4 --new 64 --layers 4 --modes greedy

Methodology and measurements: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from models import from_pretrained  # noqa: E402
from benchmarks.static_sampler import Sampler
from lopd_jax.settings.sections import SamplingParams  # noqa: E402

MODES = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.7, top_p=0.95, top_k=20)}


def paired_times(ours, hf, repeats: int):
    """Time ``ours(r)`` and ``hf(r)`` alternately over ``repeats`` rounds, after one untimed
    warm-up call of each (ours' first call, compile included, is timed and returned).

    Returns ``(first_s, ours_times, hf_times, last_ours_result, last_hf_result)``.
    """
    t0 = time.perf_counter()
    ours(0)
    first = time.perf_counter() - t0
    hf(0)  # warm-up
    t_ours, t_hf = [], []
    gen = out = None
    for r in range(repeats):
        t0 = time.perf_counter()
        gen = ours(r)
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = hf(r)
        t_hf.append(time.perf_counter() - t0)
    return first, t_ours, t_hf, gen, out


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
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--decode_layers", default="auto", choices=("auto", "unrolled", "scan"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

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
    P = int(lens.max())
    ids = torch.zeros((args.batch, P), dtype=torch.long)
    mask = torch.zeros((args.batch, P), dtype=torch.long)
    for b, pr in enumerate(prompts):
        ids[b, P - len(pr):] = torch.tensor(pr)
        mask[b, P - len(pr):] = 1
    params = Sampler.params_of(model)

    print(f"model: {n_params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"fp32); batch {args.batch}, prompts {lens.min()}-{lens.max()} tokens, {args.new} new tokens; "
          f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for mode in args.modes.split(","):
        sp = MODES[mode]
        sampler = Sampler(model, stop_ids=(), sampling=sp, decode_layers=args.decode_layers)
        hf_kw = dict(do_sample=False) if sp.temperature == 0 else dict(
            do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)

        def ours(r):
            return sampler.generate(params, prompts, args.new, jax.random.key(r))

        def hf(r):
            torch.manual_seed(r)
            with torch.no_grad():
                return hm.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                                   eos_token_id=None, pad_token_id=0, **hf_kw)

        first, t_ours, t_hf, gen, out = paired_times(ours, hf, args.repeats)
        mo, mh = statistics.median(t_ours), statistics.median(t_hf)
        line = (f"[{mode}] benchmarks.static_sampler {total / mo:7.1f} tok/s (median {mo:.2f} s, best {min(t_ours):.2f} s; "
                f"first call incl. compile {first:.2f} s) | transformers {total / mh:7.1f} tok/s (median {mh:.2f} s, "
                f"best {min(t_hf):.2f} s) | ratio {mh / mo:.2f}x (best-of {min(t_hf) / min(t_ours):.2f}x)")
        if sp.temperature == 0:
            same = sum(gen.tokens[b].tolist() == out[b, P:].tolist() for b in range(args.batch))
            line += f" | identical greedy sequences {same}/{args.batch}"
        print(line, flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
