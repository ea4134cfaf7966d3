"""Forward+backward tokens/s: our JAX decoder vs ``transformers``' PyTorch Qwen3, same weights (CPU).

One training step's work on each side (token-mean next-token cross-entropy and its gradient,
no optimizer update) on the same random-weight Qwen3 (57.9M parameters by default) and the same
token batch; losses and the largest gradient difference are printed. ``--loss fused`` (default,
:mod:`lopd_jax.method.linear_nll`) or ``plain``; ``--attention causal_plain`` (default) or
``plain``; ``--layers_impl unrolled`` (default) or ``scan``; ``--settle`` untimed calls per
side per round. Rounds alternate between the sides; the ratio is of the medians.

    python -m benchmarks.bench_forward_backward
    python -m benchmarks.bench_forward_backward --layers_impl scan --repeats 7

Methodology and measurements: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

def main(argv=None):
    """Run the benchmark and print the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per side (alternating)")
    p.add_argument("--settle", type=int, default=1,
                   help="untimed calls of a side before its timed call in each round")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--remat", default="none")
    p.add_argument("--layers_impl", default="unrolled", choices=("unrolled", "scan"))
    p.add_argument("--attention", default="causal_plain", choices=("plain", "causal_plain", "blockwise"),
                   help="our attention (causal_plain: plain attention over the causal lower-triangle tiles)")
    p.add_argument("--attention_block", type=int, default=128, help="tile size of causal_plain / blockwise")
    p.add_argument("--loss", default="fused", choices=("fused", "plain"),
                   help="our loss: fused (lopd_jax.method.linear_nll, gradient formed chunk by chunk in the forward "
                        "pass) or plain (full [B, S, V] logits, autodiff)")
    p.add_argument("--loss_chunk", type=int, default=128, help="sequence positions per chunk of the fused loss")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    import models
    from lopd_jax.method.linear_nll import weighted_linear_nll

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                                  tie_word_embeddings=False, max_position_embeddings=4096)
    hm = transformers.Qwen3ForCausalLM(hc).float()
    hm.config._attn_implementation = "sdpa"
    n_params = sum(w.numel() for w in hm.parameters())
    ids = np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as d:
        hm.save_pretrained(d)
        model = models.from_pretrained(d, dtype="float32", remat_policy=args.remat,
                                       scan_layers=args.layers_impl == "scan", attention_impl=args.attention,
                                       attention_block_q=args.attention_block, attention_block_kv=args.attention_block)

    def fused_loss(m, x):
        # The library's fused LM head + NLL (what the warm-up runs on one device): the same
        # loss and gradients, with no [B, S, V] tensor and no recomputed logits.
        hidden = m(x[:, :-1], return_hidden=True)
        targets = x[:, 1:]
        return weighted_linear_nll(hidden, m.lm_head_kernel(), targets, jnp.ones(targets.shape, jnp.float32),
                                   chunk_size=args.loss_chunk)[0]

    def plain_loss(m, x):
        # Cross-entropy as logsumexp minus the target's logit, the form the library's losses
        # use (and what torch's fused cross_entropy computes): the gradient is softmax minus a
        # one-hot, without a [B, T, V] log-softmax tensor kept for the backward pass.
        logits = m(x[:, :-1]).astype(jnp.float32)
        target = jnp.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

    loss_fn = fused_loss if args.loss == "fused" else plain_loss
    graphdef, params = nnx.split(model)
    step = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(nnx.merge(graphdef, p), x)))
    x = jnp.asarray(ids)

    def jax_step():
        return jax.block_until_ready(step(params, x))

    def timed(fn, times, faults):
        for _ in range(args.settle):
            fn()
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        return result

    tx = torch.tensor(ids)

    def torch_step():
        hm.zero_grad(set_to_none=True)
        out = hm(tx[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tx[:, 1:].reshape(-1))
        loss.backward()
        return loss

    def grad_difference(grads):
        """max over the compared tensors of max|g_jax - g_torch| / max|g_torch|."""
        flat = {path[0]: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}
        layers = hm.model.layers
        pairs = [(flat["embed"], hm.model.embed_tokens.weight.grad), (flat["lm_head"].T, hm.lm_head.weight.grad)]
        for i, layer in enumerate(layers):
            pairs += [(flat["q"][i].reshape(args.hidden, -1).T, layer.self_attn.q_proj.weight.grad),
                      (flat["gate"][i].T, layer.mlp.gate_proj.weight.grad),
                      (flat["down"][i].T, layer.mlp.down_proj.weight.grad)]
        return max(float(np.max(np.abs(a - b.numpy())) / np.max(np.abs(b.numpy()))) for a, b in pairs)

    load0 = os.getloadavg()[0]
    print(f"model: {n_params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers {args.layers_impl}, "
          f"vocab {args.vocab}, fp32, attention {args.attention}/{args.attention_block} vs sdpa); batch {args.batch} x {args.seq} tokens; torch threads "
          f"{torch.get_num_threads()}; load average {load0:.2f} on {os.cpu_count()} CPUs", flush=True)
    t0 = time.perf_counter()
    out = jax_step()  # warm-up: compiles
    first = time.perf_counter() - t0
    tl = torch_step()  # warm-up
    t_jax, t_torch, f_jax, f_torch = [], [], [], []
    for _ in range(args.repeats):
        out = timed(jax_step, t_jax, f_jax)
        tl = timed(torch_step, t_torch, f_torch)
    mj, mt = statistics.median(t_jax), statistics.median(t_torch)
    tokens = args.batch * (args.seq - 1)
    print(f"loss jax {float(out[0]):.5f} torch {float(tl.detach()):.5f}; largest gradient difference relative "
          f"to the tensor's largest entry: {grad_difference(out[1]):.1e} (embedding, LM head, every layer's q / "
          f"gate / down)")
    print(f"JAX     {tokens / mj:8.0f} tokens/s  (median {mj * 1000:.0f} ms/step, best {min(t_jax) * 1000:.0f} ms; "
          f"first call incl. compile {first:.1f} s; {statistics.median(f_jax):.0f} minor page faults/step)")
    print(f"PyTorch {tokens / mt:8.0f} tokens/s  (median {mt * 1000:.0f} ms/step, best {min(t_torch) * 1000:.0f} ms; "
          f"{statistics.median(f_torch):.0f} minor page faults/step)")
    print(f"ratio JAX / PyTorch = {mt / mj:.2f}x median of {args.repeats} alternating rounds, settle {args.settle} "
          f"(best-of {min(t_torch) / min(t_jax):.2f}x); load average {load0:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
