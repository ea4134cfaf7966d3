"""Export a run's student: ``python -m lopd_jax.export --workdir=DIR --out=HF_DIR [--step N]``.

Restores the student from the run's newest LOPD checkpoint (or ``--step``) onto the
config saved in ``DIR/config.json`` and writes it as a Hugging Face checkpoint
(safetensors + config.json + tokenizer files) that ``transformers`` loads. A LoRA-only
student is merged into theta0 (the warm-up result when the run had one, else the base
weights). An existing ``--out`` is refused unless ``--overwrite`` is given. Exit status 2 on a
bad workdir / missing checkpoint / existing ``--out``.

On a pod, run the same command on every host (with ``--coordinator_address=HOST:PORT
--num_processes=N --process_id=I`` off Cloud TPU VMs, or the environment variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; see
``docs/pods.md``): every process takes part in the sharded restore and the gather of the
student, process 0 writes the files once.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import jax

from lopd_jax.io.paths import resolve_path
from lopd_jax.programs.launcher import check_out
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.run_config import load_run_config
from train.checkpoint import CheckpointError
from train.distributed import sync
from train.launch import add_launch_flags, initialize_from_flags
from train.loop import export_student
from train.run_reader import open_run


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run directory written by python -m lopd_jax.train")
    p.add_argument("--out", required=True, help="output Hugging Face checkpoint directory (local or gs://)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (refused without it)")
    p.add_argument("--step", type=int, default=None, help="LOPD checkpoint step (default: the newest)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="tensor dtype in the files (default: the run's param dtype)")
    add_launch_flags(p)
    return p


def restore_student(workdir: str, step: int | None = None):
    """``(ctx, student, frozen)`` from the run in ``workdir`` (:func:`train.run_reader.open_run`):
    the context rebuilt from its saved config, the student params of LOPD checkpoint
    ``step`` and theta0."""

    run = open_run(workdir, load_run_config(workdir))
    student = run.student(step)
    return run.ctx, student, run.theta0()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""

    args = build_parser().parse_args(argv)
    args.workdir, args.out = resolve_path(args.workdir), resolve_path(args.out)
    error = initialize_from_flags(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2

    try:
        check_out(args.out, args.overwrite)
        ctx, student, frozen = restore_student(args.workdir, args.step)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = export_student(ctx, student, frozen, args.out, dtype=args.dtype)  # process 0 writes
    sync("export_written")  # no process reports done before the files are there
    if jax.process_index() == 0:
        print(f"wrote {len(files)} files to {args.out}: {files}")
    return 0

