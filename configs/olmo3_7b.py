"""LOPD on olmo3_7b at the paper's hyperparameters, laid out for a TPU slice (see configs/_paper.py)."""

from configs._paper import paper_config

# 32 KV heads (3.6x Qwen3-8B's KV bytes per token): the sizing rule's 10,240 pages per host
# would need 160 GiB per chip; 5,120 is the largest round pool that leaves 10% of a v5p
# chip's 95 GiB free (85.1 GiB with the weights and the trainer's params; compile_sampler's
# estimate). Episodes beyond it wait or are preempted and recomputed.
CONFIG = paper_config("olmo3_7b", workdir="workdirs/olmo3_7b", num_pages=5_120)
