"""Per-peer scripts of ``benchmarks.peer_samplers``: each runs in its peer's own venv."""
