"""Test setup: repository root on the path, 8 simulated CPU devices, fp32 matmuls, and one
persistent XLA compilation cache shared by the programs the tests start."""

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

# The tiny runs the tests start as programs (train, its resumed rerun, export, evaluate) spend
# about three quarters of their CPU time compiling, and many compile the same programs. One
# cache for the session lets a later process load what an earlier one compiled (the same
# executable, so results are unchanged). Set after `import jax`: only child processes read it;
# tests that need their own cache (test_multihost, test_gcs) still pass theirs explicitly.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="lopd-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _cache, True)
