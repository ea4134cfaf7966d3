"""Process-global numeric state that a tool call may change, restored after every call.

BFCL's ``MathAPI`` sets ``mpmath.mp.dps`` and the ``decimal`` context precision; dataset
code (EnvScaler) may do the same. :func:`preserved_numeric_state` saves the ``decimal``
context of the calling thread and, when ``mpmath`` is already imported, its
``mp.prec`` / ``mp.pretty``, and puts them back when the call returns or
raises, so one call's precision never leaks into the next.
"""

from __future__ import annotations

import contextlib
import decimal
import sys
from typing import Iterator


@contextlib.contextmanager
def preserved_numeric_state() -> Iterator[None]:
    """Run the body, then restore the ``decimal`` context and mpmath's global precision."""
    saved_decimal = decimal.getcontext().copy()
    mp = getattr(sys.modules.get("mpmath"), "mp", None)
    saved_mp = (mp.prec, mp.pretty) if mp is not None else None
    try:
        yield
    finally:
        decimal.setcontext(saved_decimal)
        mp_now = getattr(sys.modules.get("mpmath"), "mp", None)
        if mp_now is not None:
            if saved_mp is None:  # imported during the call: back to mpmath's defaults
                mp_now.dps, mp_now.pretty = 15, False
            else:
                mp_now.prec, mp_now.pretty = saved_mp
