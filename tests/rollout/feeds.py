"""An episode feed of fixed groups, shared by the engine's and the scheduler's tests (no JAX)."""

from lopd_jax.rollout.episode_spec import FeedItem


class ScriptedFeed:
    """Gives ``groups`` one by one: group ``g`` comes with ``swaps.get(g)`` (new weights and
    their version); ``drop_on_first_end`` is dropped when the first episode ends;
    ``cancel_after`` ends the run once that many episodes ended; ``idle_gap``: a broken feed
    that never gives its second group, not even to an idle engine. Records each result by
    identity and each call's ``idle`` flag."""

    def __init__(self, groups, swaps=None, cancel_after=None, idle_gap=False, drop_on_first_end=(), max_total=48):
        self.groups, self.swaps, self.cancel_after, self.idle_gap = list(groups), swaps or {}, cancel_after, idle_gap
        self.drop_on_first_end, self.drops, self.idle = list(drop_on_first_end), [], []
        self.max_total, self.cancelled, self.given, self.results = max_total, False, 0, {}

    def more(self, idle):
        """The next group (with its weights), an empty item past a gap, or None when done."""
        self.idle.append(idle)
        if self.idle_gap and self.given == 1:
            return FeedItem()
        if self.given == len(self.groups):
            return None
        g = self.given
        self.given += 1
        params, version = self.swaps.get(g, (None, 0))
        return FeedItem(self.groups[g], params, version)

    def take_drops(self):
        """The episodes to drop now."""
        drops, self.drops = self.drops, []
        return drops

    def ended(self, spec, result):
        """Record ``result``; the first end releases the drops, ``cancel_after`` ends cancel."""
        self.results[spec.identity] = result
        if len(self.results) == 1:
            self.drops, self.drop_on_first_end = self.drop_on_first_end, []
        if self.cancel_after is not None and len(self.results) >= self.cancel_after:
            self.cancelled = True
