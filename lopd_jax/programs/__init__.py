"""What the command lines in ``lopd_jax/*.py`` run: their launcher, each program's body
(imported once the launcher has configured JAX), the evaluation suite, the composer
evaluation, the ACEBench user simulator, the evaluated policy's loading and the compile
checks' length buckets."""
