"""lopd-jax: Latent On-Policy Self-Distillation (LOPD) in JAX / Flax NNX."""

__version__ = "0.1.0"
