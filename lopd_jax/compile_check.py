"""Ahead-of-time compile of a run config's LOPD step for a TPU topology, on a CPU host.

The command line of :mod:`lopd_jax.programs.compile_check`, which holds the program: this module
picks JAX's platform (:func:`lopd_jax.io.startup.configure_platform`) before anything
imports JAX, then runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from lopd_jax.io.startup import configure_platform

def _prepare_topology(argv) -> None:
    """For ``--topology=cpu:N``, simulate N host devices (the XLA flag must precede JAX's
    start); for a TPU topology, let the TPU plugin load (it compiles for the topology)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--topology", default=None)
    topology = p.parse_known_args(argv)[0].topology
    if topology is None or not topology.startswith("cpu:"):
        os.environ.setdefault("JAX_PLATFORMS", "")  # the TPU plugin compiles for the topology
    elif "jax" not in sys.modules:  # cpu:N: simulate N host devices (the flag must precede JAX's start)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={topology[4:]}"])


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: :func:`lopd_jax.programs.compile_check.main` (its exit codes)."""
    _prepare_topology(argv)
    configure_platform()  # before JAX is imported: no libtpu detection noise on CPU hosts
    from lopd_jax.programs import compile_check as program  # after configure_platform: it imports JAX

    return program.main(argv)


if __name__ == "__main__":
    sys.exit(main())
