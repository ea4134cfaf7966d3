"""Which fields of a run's records may differ between two runs of the same work: the
wall-clock and host fields (times, rates, host memory). The train tests compare records
without them."""


def volatile(key: str) -> bool:
    """True for a wall-clock or host field: the record header's ``time`` / ``elapsed``, any
    ``*seconds*`` (step, batch, rollout, evaluation, waits, the engine's times), a
    ``*per_minute`` rate, the host's memory."""
    return key in ("time", "elapsed") or "seconds" in key or key.endswith("per_minute") or key == "host_rss_mb"
