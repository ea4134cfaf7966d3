"""LOPD on olmo3_7b at the paper's hyperparameters, laid out for a TPU slice (see configs/_paper.py)."""

from configs._paper import paper_config

CONFIG = paper_config("olmo3_7b", workdir="workdirs/olmo3_7b")
