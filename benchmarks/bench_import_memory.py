"""Peak host memory of ``models.hf_import.from_pretrained`` on a ~1 GB checkpoint.

Writes a random Qwen3-shaped checkpoint (bf16, sharded safetensors with index) to a temp
dir, imports it in a fresh subprocess (so earlier allocations do not count) and reports
peak RSS growth during the import against the largest tensor, the largest stacked
parameter and the checkpoint size. On a CPU backend the imported parameters themselves
live in host memory, so the figure of merit is the transient overhead: peak growth minus
the bytes of the loaded model.

    python -m benchmarks.bench_import_memory [--layers 8] [--hidden 2048] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_checkpoint(path: str, layers: int, hidden: int, vocab: int) -> dict:
    """A random bf16 Qwen3 checkpoint, one safetensors shard per layer (plus embeddings)."""
    import ml_dtypes
    import numpy as np
    import safetensors.numpy

    from models import hf_mapping
    from models.config import qwen3
    from models.layer import projection_shapes
    from models.hf_config import to_hf_config

    cfg = qwen3(hidden, 3 * hidden, layers, 16, 8, tie=False, vocab=vocab, head_dim=128)
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    proj = projection_shapes(cfg)
    shapes = {"embed": (vocab, hidden), "final_norm": (hidden,), "lm_head": (hidden, vocab),
              "attn_norm": (hidden,), "mlp_norm": (hidden,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    for name, (ins, outs, _, _) in proj.items():
        shapes[name] = (*ins, *outs)

    def rand(rule):
        hf_shape = rule.transform.hf_shape(shapes[rule.ours])
        return (rng.standard_normal(hf_shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    weight_map, total, largest = {}, 0, 0
    groups = {"model-embed.safetensors": [r for r in hf_mapping.table(cfg) if not r.stacked]}
    groups.update({f"model-layer{i:03d}.safetensors": [(r, i) for r in hf_mapping.table(cfg) if r.stacked]
                   for i in range(layers)})
    for fname, items in groups.items():
        tensors = {}
        for item in items:
            rule, i = item if isinstance(item, tuple) else (item, None)
            name = rule.hf.format(i=i) if i is not None else rule.hf
            tensors[name] = rand(rule)
            weight_map[name] = fname
            total += tensors[name].nbytes
            largest = max(largest, tensors[name].nbytes)
        safetensors.numpy.save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg, dtype="bfloat16"), f)
    stacked = max(layers * 2 * int(np.prod(shapes[r.ours])) for r in hf_mapping.table(cfg) if r.stacked)
    return {"checkpoint_bytes": total, "largest_tensor_bytes": largest, "largest_stacked_param_bytes": stacked,
            "num_params": cfg.num_params()}


_CHILD = r"""
import json, os, resource, sys, threading, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import psutil, jax, numpy as np
from flax import nnx
from models.hf_import import from_pretrained
jax.block_until_ready(jax.device_put(np.zeros(4)))  # start the backend before the baseline
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.005)
t = threading.Thread(target=sample, daemon=True); t.start()
t0 = time.time()
model = from_pretrained(PATH, dtype="bfloat16")
jax.block_until_ready([v[...] for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)])
secs = time.time() - t0
stop.set(); t.join()
after = proc.memory_info().rss
model_bytes = sum(v[...].nbytes for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"rss_before": base, "rss_after": after, "rss_peak_sampled": peak[0],
                  "ru_maxrss": maxrss, "model_bytes": model_bytes, "import_seconds": secs}))
"""


def measure(path: str) -> dict:
    """Import ``path`` in a fresh Python process and return its memory figures."""
    code = _CHILD.replace("ROOT", repr(ROOT)).replace("PATH", repr(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"import subprocess failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    """Write the checkpoint, measure the import, print a JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or os.path.join(tmp, "ckpt")
        t0 = time.time()
        info = write_checkpoint(path, args.layers, args.hidden, args.vocab)
        info["write_seconds"] = time.time() - t0
        m = measure(path)
    peak = max(m["rss_peak_sampled"], m["ru_maxrss"])
    growth = peak - m["rss_before"]
    mb = 1 / 2**20
    report = {
        **{k: round(v * mb, 1) for k, v in info.items() if k.endswith("bytes")},
        "num_params": info["num_params"],
        "model_bytes": round(m["model_bytes"] * mb, 1),
        "peak_rss_growth": round(growth * mb, 1),
        "rss_growth_after": round((m["rss_after"] - m["rss_before"]) * mb, 1),
        "transient_overhead": round((growth - m["model_bytes"]) * mb, 1),
        "peak_growth_over_checkpoint": round(growth / info["checkpoint_bytes"], 3),
        "overhead_over_largest_tensor": round((growth - m["model_bytes"]) / info["largest_tensor_bytes"], 3),
        "overhead_over_largest_stacked_param": round(
            (growth - m["model_bytes"]) / info["largest_stacked_param_bytes"], 3),
        "import_seconds": round(m["import_seconds"], 1),
        "write_seconds": round(info["write_seconds"], 1),
        "units": "MiB",
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
