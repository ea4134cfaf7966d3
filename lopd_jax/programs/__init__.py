"""What the command lines in ``lopd_jax/*.py`` run: each program's body (imported once its
command line has configured JAX), the evaluation suite, the composer evaluation, the
ACEBench user simulator, the evaluated policy's loading and the compile checks' length
buckets."""
