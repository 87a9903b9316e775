"""Logs: one configuration for the gateway's and uvicorn's loggers, as text for people or JSON for shippers.

`sluice serve` builds it once (`config()` is a `logging.config.dictConfig` dict, so uvicorn hands the same one
to every worker process). Text lines are `time level logger: message key=value...`; JSON lines are one
object each, `{"ts", "level", "logger", "message", ...fields}`. Structured fields travel in
`extra={"fields": {...}}`, so that a line is cheap to make and its fields need no parsing downstream.

What the gateway logs at info: a start-up summary, one line per state change (a backend down or up, an SLO
degrading or recovering, Redis lost or back, the trace collector failing or recovered), and, when asked for,
one access line per request. Never a credential: backends' keys and clients' keys appear nowhere.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
LEVELS = ("critical", "error", "warning", "info", "debug")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record.created)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{key}={_text(value)}" for key, value in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class SaidByTheGateway(logging.Filter):
    """Drops uvicorn's "Cancel N running task(s)" at the end of the grace period (the gateway logs the count
    of requests it ended itself, with what the clients got), and names uvicorn's lines "uvicorn"."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn says everything, its start-up lines included, under the name "uvicorn.error": shown as plain
        # "uvicorn", so that an INFO line does not read as an error.
        record.name = "uvicorn"
        return not str(record.msg).startswith("Cancel %s running task(s)")


def config(level: str = "info", format: LogFormat = "text") -> dict[str, Any]:
    """The dictConfig for the gateway's loggers (`sluice.*`) and uvicorn's, on stderr."""
    formatter = "gateway.telemetry.logs.JsonFormatter" if format == "json" else "gateway.telemetry.logs.TextFormatter"
    name = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": formatter}},
        "filters": {"gateway": {"()": "gateway.telemetry.logs.SaidByTheGateway"}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
        },
        "loggers": {
            "sluice": {"handlers": ["stderr"], "level": name, "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": name, "propagate": False},
            "uvicorn.error": {"level": name, "filters": ["gateway"]},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},  # ours is sluice.access
            # The OTLP exporter logs every failed batch; sluice.tracing says once when it fails and recovers.
            "opentelemetry.exporter": {"level": "CRITICAL"},
        },
        # Libraries' warnings (the OTLP exporter's, say) in the same format.
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }


def fields(**values: Any) -> dict[str, dict[str, Any]]:
    """`log.info("...", extra=fields(backend="x"))`."""
    return {"fields": values}


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _text(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    return f'"{text}"' if not text or " " in text or '"' in text else text
