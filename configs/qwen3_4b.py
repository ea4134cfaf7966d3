"""LOPD on qwen3_4b at the paper's hyperparameters, laid out for a v5e slice (see configs/_paper.py).

v5e chips have 16 GiB of HBM and batch 32 cannot split 64 / 256 ways, so: FSDP over 32
chips (one trajectory each), the rest of the slice on the tensor axis (2 on v5e-64, 8 on
v5e-256) with the layer activations' embedding dimension sharded over it too
(``act_embed -> tensor``). The compile check's measurements: docs/results.md.
"""

from configs._paper import paper_config
from lopd_jax.settings.sections import MeshConfig
from models.partitioning import DEFAULT_RULES

RULES = tuple((name, "tensor" if name == "act_embed" else axes) for name, axes in DEFAULT_RULES)

# the engine's pool per host of 4 v5e chips (16 GiB each): 2,560 pages (13.4 GiB per chip
# with the weights and the trainer's params on v5e-64, compile_sampler's estimate; the
# sizing rule's 9,774 would need 45); on v5p-32 the rule's 10,240 fit (engine.num_pages=10240)
CONFIG = paper_config("qwen3_4b", workdir="workdirs/qwen3_4b",
                      mesh=MeshConfig(data=1, fsdp=32, tensor=-1, rules=RULES), num_pages=2_560)
