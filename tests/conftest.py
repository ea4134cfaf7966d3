"""Test setup: 8 simulated CPU devices, fp32 matmuls, offline hubs, and one persistent XLA
compilation cache shared by every process of the run (the workers and the programs the
tests start)."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# XLA compiling the same tiny programs is most of the suite's CPU time: many tests build
# their own model or step (a new jitted function, so the in-memory cache misses) and the
# programs the tests start (train, its resumed rerun, export, evaluate, the documented
# commands) start cold. One persistent compilation cache for the whole run -- the pytest
# process, its xdist workers (they inherit the variable from the controller, whose conftest
# runs first) and every child process -- lets each program compile once per run. Entries are
# keyed by XLA on the program itself, so changed code cannot be served a stale executable.
# `make test` names the directory (LOPD_TEST_CACHE_DIR); otherwise this makes a temporary
# one for the run and removes it at exit. Tests that need a cache of their own
# (test_multihost, test_gcs) pass theirs explicitly.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = os.environ.get("LOPD_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="lopd-tests-xla-cache-")
    os.makedirs(_cache, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    if not os.environ.get("LOPD_TEST_CACHE_DIR"):
        atexit.register(shutil.rmtree, _cache, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
