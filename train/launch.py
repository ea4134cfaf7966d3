"""The multi-process launch flags every command-line program that runs on a pod takes.

``--coordinator_address=HOST:PORT --num_processes=N --process_id=I`` (or the environment
variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; nothing
on a Cloud TPU VM slice, which is detected): :func:`add_launch_flags` adds them to a
parser, :func:`initialize_from_flags` starts the multi-controller runtime from them with
:func:`train.distributed.initialize`. This module does not import JAX (parsers are
built before :func:`lopd_jax.io.startup.configure_platform` may have run).
"""

from __future__ import annotations

import argparse

from train.distributed import initialize


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--coordinator_address``, ``--num_processes`` and ``--process_id`` to ``parser``."""
    parser.add_argument("--coordinator_address", default=None,
                        help="multi-process run: HOST:PORT of process 0 (or $JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num_processes", type=int, default=None,
                        help="multi-process run: N (or $JAX_NUM_PROCESSES)")
    parser.add_argument("--process_id", type=int, default=None,
                        help="multi-process run: this process, 0..N-1 (or $JAX_PROCESS_ID); automatic on TPU VMs")


def initialize_from_flags(args: argparse.Namespace) -> str | None:
    """Start the runtime from the flags of :func:`add_launch_flags` (and the environment)
    when the run is multi-process; returns an error message for an incomplete or
    inconsistent launch (the program then exits with status 2), else None."""
    try:
        initialize(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        return str(e)
    return None


__all__ = ["add_launch_flags", "initialize_from_flags"]
