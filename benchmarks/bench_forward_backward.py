"""Forward+backward tokens/s: our JAX decoder vs transformers' PyTorch Qwen3, same weights.

    python benchmarks/bench_forward_backward.py [--hidden 512 --layers 8 --vocab 32000 --batch 4 --seq 512]

Both compute the token-mean cross-entropy of next-token prediction and its gradient with
respect to all parameters, in fp32, on the same inputs, in one process; the ratio
JAX / PyTorch is printed (goal >= 1.5x on CPU).
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--remat", default="none")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    import models

    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                                  tie_word_embeddings=False, max_position_embeddings=4096)
    hm = transformers.Qwen3ForCausalLM(hc).float()
    hm.config._attn_implementation = "sdpa"
    ids = np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as d:
        hm.save_pretrained(d)
        model = models.from_pretrained(d, dtype="float32", remat_policy=args.remat)

    def loss_fn(m, x):
        logits = m(x[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1))

    graphdef, params = nnx.split(model)
    step = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(nnx.merge(graphdef, p), x)))
    x = jnp.asarray(ids)
    jax.block_until_ready(step(params, x))  # compile
    t = time.perf_counter()
    for _ in range(args.iters):
        out = step(params, x)
    jax.block_until_ready(out)
    jax_s = (time.perf_counter() - t) / args.iters

    tx = torch.tensor(ids)
    def torch_step():
        hm.zero_grad(set_to_none=True)
        out = hm(tx[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tx[:, 1:].reshape(-1))
        loss.backward()
        return loss
    torch_step()  # warm-up
    t = time.perf_counter()
    for _ in range(args.iters):
        tl = torch_step()
    torch_s = (time.perf_counter() - t) / args.iters
    tokens = args.batch * (args.seq - 1)
    print(f"loss jax {float(out[0]):.5f} torch {float(tl):.5f}")
    print(f"JAX     {tokens / jax_s:10.0f} tokens/s  ({jax_s * 1000:.0f} ms/step)")
    print(f"PyTorch {tokens / torch_s:10.0f} tokens/s  ({torch_s * 1000:.0f} ms/step, {torch.get_num_threads()} threads)")
    print(f"ratio JAX / PyTorch = {torch_s / jax_s:.2f}x")


if __name__ == "__main__":
    main()
