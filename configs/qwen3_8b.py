"""LOPD on qwen3_8b at the paper's hyperparameters, laid out for a TPU slice (see configs/_paper.py)."""

from configs._paper import paper_config

CONFIG = paper_config("qwen3_8b", workdir="workdirs/qwen3_8b")
