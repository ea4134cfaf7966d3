"""The demo (``make demo``): LOPD learning on the CPU miniature, from a shipped starting point.

The command line of :mod:`lopd_jax.programs.demo`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("demo")

if __name__ == "__main__":
    sys.exit(main())
