"""Ahead-of-time compile of the rollout engine's decode step for a TPU topology, on a CPU host.

The command line of :mod:`lopd_jax.programs.compile_sampler`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("compile_sampler", topology=True)

if __name__ == "__main__":
    sys.exit(main())
