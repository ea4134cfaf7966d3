"""The policy a program evaluates: a Hugging Face checkpoint (or ``gs://`` prefix) with its
tokenizer, or ``tiny`` -- the ``tiny_qwen3`` backbone with random weights and the tiny
Qwen3-format tokenizer -- and its parameters placed on a mesh."""

from __future__ import annotations

from flax import nnx

from lopd_jax.chat.tokenizers import hf_tokenizer, qwen3_tokenizer, tiny_tokenizer
from models import from_pretrained
from models.config import named_config
from models.decoder import Decoder
from models.lora import LoRAParam
from train import mesh as mesh_lib
from models.partitioning import split_state, tree_shardings

TINY = "tiny"


def load_policy(model_arg: str, *, seed: int = 0, dtype: str = "float32", rules=None):
    """``(model, tokenizer, family)`` for ``--model``; ``rules`` (a :class:`models.partitioning.Rules`
    bound to a mesh): build the model for that mesh (see :func:`sharded_params`)."""
    if model_arg == TINY:
        tok = tiny_tokenizer("qwen3")
        cfg = named_config("tiny_qwen3", dtype=dtype, param_dtype=dtype)
        cfg = cfg.replace(vocab_size=max(cfg.vocab_size, -(-len(tok) // 64) * 64))
        return Decoder(cfg, rngs=nnx.Rngs(seed), rules=rules), tok, "qwen3"
    model = from_pretrained(model_arg, dtype=dtype, **({} if rules is None else {"mesh": rules.mesh, "rules": rules}))
    try:
        tok = hf_tokenizer(model_arg)  # local or gs://
    except (OSError, ValueError) as e:
        if model.cfg.family != "qwen3":
            raise ValueError(f"no tokenizer files in {model_arg!r} ({e}); save the checkpoint's tokenizer "
                             "there (tokenizer.save_pretrained)") from e
        tok = qwen3_tokenizer()
    if len(tok) > model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens but the model's vocabulary is {model.cfg.vocab_size}")
    return model, tok, model.cfg.family


def sharded_params(model, rules) -> dict:
    """The rollout's parameter dict of ``model`` placed on ``rules``' mesh by each
    parameter's logical axes (the layout a training run gives theta0)."""

    _, states, axes = split_state(model, nnx.Param, LoRAParam)
    params: dict = {}
    for state, ax in zip(states, axes):
        params.update(mesh_lib.put(state, tree_shardings(state, ax, rules)))
    return params
