"""A turn's answer as the socket's messages: however the stream is cut into reads, the same events come out."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.responses.socket_responder import Responder
from gateway.server.websocket import SEND_MANY
from gateway.wire import response_events

RESPONSE: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "m",
    "output": [
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "annotations": [], "text": "one two three"}],
        }
    ],
    "usage": {"input_tokens": 1, "output_tokens": 3, "total_tokens": 4},
}
STREAM = response_events.replay(RESPONSE)
EXPECTED = [event for group in response_events.stream_events(RESPONSE) for event in group]


def answer(pieces: list[bytes], status: int = 200, lane: str | None = None, many: bool = False) -> tuple[Any, ...]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        raise AssertionError("a turn that is not watched never reads its receive")

    responder = Responder(send, receive, lane, many)

    async def run() -> None:
        await responder.send({"type": "http.response.start", "status": status, "headers": [(b"retry-after", b"2")]})
        for i, piece in enumerate(pieces):
            await responder.send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1})

    asyncio.run(run())
    texts: list[str] = []
    for message in sent:
        texts.extend(message["texts"] if message["type"] == SEND_MANY else [message["text"]])
    return [orjson.loads(text) for text in texts], sent, responder


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
def test_the_same_events_whatever_the_reads(cuts: list[int]) -> None:
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    events, _, responder = answer(pieces)
    assert events == EXPECTED
    assert responder.response == RESPONSE  # kept for the socket's memory
    assert not responder.failed


def test_one_read_s_events_go_out_in_one_message_when_the_server_takes_several() -> None:
    events, sent, _ = answer([STREAM], many=True)
    assert events == EXPECTED
    assert [message["type"] for message in sent] == [SEND_MANY]
    _, one_by_one, _ = answer([STREAM])
    assert len(one_by_one) == len(EXPECTED)


def test_a_lane_s_events_echo_its_stream_id() -> None:
    events, _, _ = answer([STREAM], lane="b")
    assert all(event["stream_id"] == "b" for event in events)
    assert [{k: v for k, v in event.items() if k != "stream_id"} for event in events] == EXPECTED


def test_an_error_answer_is_one_error_event_with_its_status_and_retry_after() -> None:
    body = errors.RateLimitError("slow down", code="rate_limit_exceeded").body()
    events, _, responder = answer([body[:10], body[10:]], status=429)
    assert events == [
        {
            "type": "error",
            "status": 429,
            "error": orjson.loads(body)["error"],
            "headers": {"retry-after": "2"},
        }
    ]
    assert responder.failed
    assert responder.response is None


def test_a_stream_that_breaks_ends_with_an_error_event() -> None:
    head = STREAM[: STREAM.index(b"response.output_text.delta")]
    head = head[: head.rindex(b"\n\n") + 2]
    broken = errors.UpstreamError("upstream closed the stream", code="upstream_error").sse_event()
    events, _, responder = answer([head, broken])
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "upstream_error"
    assert responder.failed
