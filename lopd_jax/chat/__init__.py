"""Chat formats by model family (Qwen3, Olmo-3, ChatML), their templates, tokenizers and the
limits on tool calls in a turn; :mod:`lopd_jax.chat.formats` chooses one by name."""
