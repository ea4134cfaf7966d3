"""Train with LOPD end to end: ``python -m lopd_jax.train --config=NAME --workdir=DIR [key=value ...]``.

The command line of :mod:`lopd_jax.programs.train`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("train")

if __name__ == "__main__":
    sys.exit(main())
