"""Export a run's student: ``python -m lopd_jax.export --workdir=DIR --out=HF_DIR [--step N]``.

The command line of :mod:`lopd_jax.programs.export`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("export")

if __name__ == "__main__":
    sys.exit(main())
