"""The premise check of self-distillation: does a privileged context help theta0 at all?

The command line of :mod:`lopd_jax.programs.premise`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("premise")

if __name__ == "__main__":
    sys.exit(main())
