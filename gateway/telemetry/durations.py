"""Durations as the response's headers write them: milliseconds with three decimals, without a float's format.

`server-timing` and `x-sluice-overhead-ms` (server_timing below, ms_value) and the console's waterfall, which repeats
what the header said (telemetry/console.py), all write a duration here, so that they agree to the digit.
"""

from __future__ import annotations

# `;dur=` values under a millisecond, made once: formatting a float costs more than the rest of the header
# (callgrind: 27k instructions for eight stages, 18k with this table).
SUB_MS = [f";dur=0.{us:03d}" for us in range(1000)]
OVERHEAD_SUB_MS = ["overhead" + piece for piece in SUB_MS]
MS_VALUES = [b"0.%03d" % us for us in range(1000)]  # `x-sluice-overhead-ms` under a millisecond
# Past a millisecond, the whole milliseconds as an integer and the three decimals from a table: a float's
# format (`{ms:.3f}`) is the costliest part of the header, and compiled it becomes a `str.format` call
# (callgrind, compiled: 10.2k instructions a request for the header's five stages, under callgrind's slowness
# all past a millisecond).
FRACTIONS = [f".{us:03d}" for us in range(1000)]
MAX_TABLED_MS = 1e9  # beyond (or NaN, or negative: a clock step), the float's own format


def ms_text(ms: float) -> str:
    """`ms` with three decimals, as f"{ms:.3f}" writes it (rounding half up on the microsecond)."""
    if 0.0 <= ms < MAX_TABLED_MS:
        whole, us = divmod(int(ms * 1000.0 + 0.5), 1000)
        return str(whole) + FRACTIONS[us]
    return f"{ms:.3f}"


def ms_value(ms: float) -> bytes:
    """`ms` with three decimals, as f"{ms:.3f}" writes it: from a table under a millisecond."""
    us = int(ms * 1000.0 + 0.5) if 0.0 <= ms < MAX_TABLED_MS else -1
    return MS_VALUES[us] if 0 <= us < 1000 else ms_text(ms).encode()


def server_timing(timings: list[tuple[str, float]], overhead_ms: float) -> bytes:
    """`parse;dur=0.021, upstream;dur=152.304, overhead;dur=0.310` (milliseconds, per the spec)."""
    # int() rounds toward zero, so a negative duration (a clock step) would print as 0.000: the table serves
    # only 0 <= ms < 1, everything else takes the format. A plain loop: cheaper in 3.11 than a comprehension's
    # frame (callgrind: 10.4k instructions for two stages, 11.9k as a comprehension, 12.1k before either).
    parts = []
    for stage, ms in timings:
        if 0.0 <= ms < 1.0 and (us := int(ms * 1000.0 + 0.5)) < 1000:
            parts.append(stage + SUB_MS[us])
        else:
            parts.append(stage + ";dur=" + ms_text(ms))
    if 0.0 <= overhead_ms < 1.0 and (us := int(overhead_ms * 1000.0 + 0.5)) < 1000:
        parts.append(OVERHEAD_SUB_MS[us])
    else:
        parts.append("overhead;dur=" + ms_text(overhead_ms))
    return ", ".join(parts).encode()
