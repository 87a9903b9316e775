"""W3C trace context at the gateway's edge: the incoming `traceparent`, and whether to trace at all.

Kept apart from `tracing.py` so that a gateway with tracing off never imports the OpenTelemetry SDK: it only
passes a client's trace context upstream. What goes upstream is always the four fields of version 00, rebuilt
from the parsed ids and flags, never the client's bytes: a later version's extra fields (of any length) are
dropped, as W3C asks of a hop that speaks version 00, and an invalid header is not passed on at all (the
upstream, or the gateway's own tracing, starts a new trace).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.settings import TelemetrySettings

# version-traceid-parentid-flags in lower-case hex; versions after 00 may append fields.
TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def enabled(settings: TelemetrySettings) -> bool:
    """Whether to trace, decided once at start-up: only when there is somewhere to send spans."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if settings.exporter == "zipkin":
        return bool(settings.zipkin_endpoint)
    return bool(settings.otlp_endpoint or any(os.environ.get(name) for name in ENDPOINT_VARIABLES))


def describe(settings: TelemetrySettings) -> str:
    """The start-up line about tracing: whether it is on, and where spans go, as `enabled` and the exporter decide."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "off (OTEL_SDK_DISABLED=true)"
    if not enabled(settings):
        where = (
            "telemetry.zipkin_endpoint"
            if settings.exporter == "zipkin"
            else ("telemetry.otlp_endpoint, OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        return f"off (no {where} set)"
    if settings.exporter == "zipkin":
        url = settings.zipkin_endpoint
    else:
        url = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or ""
        if not url:
            base = (settings.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")).rstrip("/")
            url = base if base.endswith("/v1/traces") else base + "/v1/traces"
    service = os.environ.get("OTEL_SERVICE_NAME") or settings.service_name
    return f"{settings.exporter} to {url}, sample ratio {settings.sample_ratio:g}, service {service}"


def incoming(headers: list[tuple[bytes, bytes]]) -> re.Match[bytes] | None:
    """The client's `traceparent` if it is one that may be continued: groups 2, 3, 4 are trace, parent, flags.

    Two `traceparent` headers are one invalid header (W3C: they cannot be combined), so none is continued.
    """
    found: re.Match[bytes] | None = None
    seen = False
    for name, value in headers:
        if name == b"traceparent":
            if seen:
                return None
            seen = True
            found = TRACEPARENT.fullmatch(value.strip())
            if found is None or found[1] == b"ff" or (found[1] == b"00" and found[5]):
                return None
            if found[2] == b"0" * 32 or found[3] == b"0" * 16:
                return None
    return found


def rebuilt(found: re.Match[bytes]) -> bytes:
    """The four fields of version 00 from a parsed `traceparent`, whatever version and suffix it came with."""
    return b"00-%b-%b-%b" % (found[2], found[3], found[4])


def forward(ex: Exchange) -> None:
    """Tracing off: a valid incoming `traceparent` goes upstream as version 00 with the same ids and flags."""
    found = incoming(ex.headers)
    if found is not None:
        ex.traceparent = rebuilt(found)
