"""Test setup: 8 simulated CPU devices, fp32 matmuls, offline hubs, and one persistent XLA
compilation cache shared by every process of the run (the workers and the programs the
tests start)."""

import atexit
import json
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# XLA's CPU compiler at its lowest effort: the tests' programs are tiny, so compiling is most of
# their time and optimising it buys nothing (about a third less compile time on the LOPD step).
# Environment variables, so every program a test starts compiles the same way. Tests that
# compare two programs bit for bit compare two programs compiled with the same options.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "-1")
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
# Only programs that took a second or more to compile are written: those are what the cache
# saves (with every program written, 4,654 entries saved 42 s in the pytest processes), and each
# write serialises the executable -- where a pytest worker crashed on CI (a fatal signal in
# jaxlib's executable.serialize()).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# How many programs the run compiled and how many the cache served, summed over the pytest
# processes (the controller and its workers; each writes its counts at the end of its
# session) and printed at the end of the run: the figure the next cut can aim at.
if "LOPD_TEST_STATS_DIR" not in os.environ:
    os.environ["LOPD_TEST_STATS_DIR"] = tempfile.mkdtemp(prefix="lopd-tests-compile-stats-")
    atexit.register(shutil.rmtree, os.environ["LOPD_TEST_STATS_DIR"], True)
_COMPILES = {"requests": 0, "hits": 0, "saved_seconds": 0.0, "compile_seconds": 0.0}


def _count_event(event: str, **_):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        _COMPILES["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        _COMPILES["hits"] += 1


def _count_duration(event: str, seconds: float, **_):
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        _COMPILES["saved_seconds"] += seconds
    elif event == "/jax/core/compile/backend_compile_duration":  # a cache hit's load included
        _COMPILES["compile_seconds"] += seconds


jax.monitoring.register_event_listener(_count_event)
jax.monitoring.register_event_duration_secs_listener(_count_duration)


def pytest_sessionfinish(session):
    """Each pytest process writes its compile counts for the summary."""
    with open(os.path.join(os.environ["LOPD_TEST_STATS_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(_COMPILES, f)


def pytest_terminal_summary(terminalreporter):
    """One line: XLA programs compiled and served by the run's persistent cache."""
    if hasattr(terminalreporter.config, "workerinput"):
        return
    folder = os.environ["LOPD_TEST_STATS_DIR"]
    total = dict.fromkeys(_COMPILES, 0)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for k, v in json.load(f).items():
                total[k] += v
    terminalreporter.write_line(
        f"XLA in the pytest processes: {total['requests']} compile requests, {total['hits']} served by the "
        f"persistent cache ({total['saved_seconds']:.0f} s of compiling saved), {total['requests'] - total['hits']} "
        f"compiled; {total['compile_seconds']:.0f} s in compile calls")
