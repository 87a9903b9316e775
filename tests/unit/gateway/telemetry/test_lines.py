"""What a log line says: the text and JSON forms, the access line of a request and of a refusal, the percentile."""

from __future__ import annotations

import logging
import math
import time

import orjson
import pytest

from gateway import errors
from gateway.context import Exchange
from gateway.plugin import Outcome
from gateway.telemetry.access import access_line, refusal_line
from gateway.telemetry.logs import JsonFormatter, SaidByTheGateway, TextFormatter, config
from gateway.telemetry.quantiles import percentile


def record(message: str = "backend %s down", *args: object, **fields: object) -> logging.LogRecord:
    made = logging.LogRecord("sluice.upstream", logging.WARNING, __file__, 1, message, args or ("a",), None)
    made.created = 0.25  # 1970-01-01T00:00:00.250Z
    if fields:
        made.fields = fields
    return made


def test_text_lines_quote_what_has_spaces_and_mark_what_is_missing() -> None:
    line = TextFormatter().format(record(error="no route to host", tenant=None, status=503))
    assert line == (
        '1970-01-01T00:00:00.250Z WARNING sluice.upstream: backend a down error="no route to host" tenant=- status=503'
    )


def test_json_lines_are_one_object_with_the_fields_at_the_top() -> None:
    entry = orjson.loads(JsonFormatter().format(record(status=503)))
    assert entry == {
        "ts": "1970-01-01T00:00:00.250Z",
        "level": "warning",
        "logger": "sluice.upstream",
        "message": "backend a down",
        "status": 503,
    }


def test_uvicorns_lines_are_named_uvicorn_and_its_task_count_dropped() -> None:
    keep = SaidByTheGateway()
    said = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process", (), None)
    assert keep.filter(said)
    assert said.name == "uvicorn"
    cancel = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Cancel %s running task(s)", (2,), None)
    assert not keep.filter(cancel)


@pytest.mark.parametrize("form", ["text", "json"])
def test_the_config_names_its_formatter(form: str) -> None:
    made = config("debug", "json" if form == "json" else "text")
    assert made["formatters"]["default"]["()"].endswith("JsonFormatter" if form == "json" else "TextFormatter")
    assert made["loggers"]["sluice"]["level"] == "DEBUG"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def logger() -> tuple[logging.Logger, Kept]:
    log = logging.getLogger(f"test.access.{time.perf_counter_ns()}")
    log.propagate = False
    log.setLevel(logging.INFO)
    kept = Kept()
    log.addHandler(kept)
    return log, kept


def test_an_access_line_says_who_what_and_how_it_went() -> None:
    log, kept = logger()
    ex = Exchange("r-1", "chat/completions", [], b"{}", {"model": "m"}, time.perf_counter())
    ex.tenant = "acme"
    ex.labels = {"cache": "miss"}
    outcome = Outcome(status=200, complete=True, ttft_ms=12.3456, total_ms=40.0)
    access_line(log, ex, outcome)
    (line,) = kept.records
    assert line.getMessage() == "chat/completions 200"
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["request_id"] == "r-1"
    assert fields["tenant"] == "acme"
    assert fields["ttft_ms"] == 12.346
    assert fields["total_ms"] == 40.0
    assert fields["cache"] == "miss"


def test_a_client_gone_before_the_head_is_a_499() -> None:
    log, kept = logger()
    ex = Exchange("r-2", "chat/completions", [], b"{}", {"model": "m"}, time.perf_counter())
    access_line(log, ex, Outcome(0))
    assert kept.records[0].getMessage() == "chat/completions 499"


def test_a_refusal_line_has_the_same_fields_those_not_known_empty() -> None:
    log, kept = logger()
    error = errors.NotFoundError("unknown URL", code="unknown_url")
    refusal_line(log, "GET /nowhere", error, "r-3", time.perf_counter(), extra={"socket": "s-1"})
    (line,) = kept.records
    assert line.getMessage() == "GET /nowhere 404"
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["tenant"] is None
    assert fields["rejected_by"] == "gateway"
    assert fields["error"] == "unknown_url"
    assert fields["socket"] == "s-1"


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0, 1.0], 0.0) == 1.0
    assert percentile([5.0, 1.0], 1.0) == 5.0
    assert percentile([7.0], 0.95) == 7.0
    assert math.isnan(percentile([], 0.5))
