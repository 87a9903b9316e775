"""Where the time went: stage timings to a Server-Timing header (and, later, metrics and spans).

Stage timings are taken with perf_counter on the request path; everything built from them is built
once per request, after the stages ran.
"""

from __future__ import annotations


def server_timing(timings: list[tuple[str, float]], overhead_ms: float) -> bytes:
    """`parse;dur=0.021, upstream;dur=152.304, overhead;dur=0.310` (milliseconds, per the spec)."""
    parts = [f"{stage};dur={ms:.3f}" for stage, ms in timings]
    parts.append(f"overhead;dur={overhead_ms:.3f}")
    return ", ".join(parts).encode()
