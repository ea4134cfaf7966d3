"""Defaults of the method that several modules share, written once (arXiv 2608.13040).

``TOP_M``: the teacher's top-M tokens the reverse KL is taken over (plus one tail bucket
for the rest of the vocabulary). ``MARGIN``: the privilege margin m of the composer's
Lagrangian constraint: Δ, the advantage-weighted mean log-likelihood gap of the teacher
conditioned on latents over the student on the student's sampled tokens, must be at least m
(measured against the student, as the code and the release do). docs/method.md explains both.
``LOGITS_CHUNK``: sequence positions per chunk of the LM-head projection in the losses (the
full [B, S, V] logits are never held at once).
"""

TOP_M = 20
MARGIN = 0.05
LOGITS_CHUNK = 512

__all__ = ["LOGITS_CHUNK", "MARGIN", "TOP_M"]
