"""An engine run's page pool bookkeeping (:class:`Pages`, :mod:`lopd_jax.rollout.scheduler`). No JAX."""

from __future__ import annotations

from lopd_jax.rollout.episode_spec import EpisodeState

__all__ = ["Pages"]


class Pages:
    """One run's page pool: the free page ids (taken from the end) and the most in use."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.free = list(range(num_pages - 1, -1, -1))
        self.peak = 0

    def grow(self, ep: EpisodeState, tokens: int) -> bool:
        """Pages for ``tokens`` cached ids (never beyond the episode cap); False when the pool
        has too few free pages."""
        need = -(-min(tokens, ep.spec.max_total) // self.page_size) - len(ep.pages)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            ep.pages.append(self.free.pop())
        self.peak = max(self.peak, self.num_pages - len(self.free))
        return True

    def release(self, ep: EpisodeState) -> None:
        """Give back ``ep``'s pages (its cache is gone)."""
        self.free.extend(reversed(ep.pages))
        ep.pages = []
        ep.cached = 0

