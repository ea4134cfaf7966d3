"""Shape buckets: pad a size up to one of a few values, so jitted programs compile once per bucket.

Used by the sampler (batch and token buckets), the step batches and the backbone embedder.
"""

from __future__ import annotations

from typing import Sequence


def bucket(n: int, buckets: Sequence[int] = (), minimum: int = 1, multiple_of: int = 1) -> int:
    """The smallest configured bucket >= ``n``, else the next power of two >= max(n, minimum),
    rounded up to a multiple of ``multiple_of``."""
    n = max(int(n), 1)
    size = next((b for b in buckets if b >= n), None)
    if size is None:
        size = 1 << (max(n, minimum) - 1).bit_length()
    return -(-size // multiple_of) * multiple_of


__all__ = ["bucket"]
