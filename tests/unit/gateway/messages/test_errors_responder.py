"""The Messages route's responder: every error the pipeline answers leaves in Anthropic's shape, the rest as is."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway.messages.api import AnthropicErrors

OPENAI_404 = orjson.dumps({"error": {"message": "model: nope", "type": "invalid_request_error", "code": None}})


class Recording:
    """A responder that keeps what it was given."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.answered: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = []
        self.watching = False

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        self.answered.append((status, list(headers), body))

    def watch(self, gone: Callable[[], None]) -> None:
        self.watching = True

    def unwatch(self) -> None:
        self.watching = False


async def test_an_error_head_is_held_until_its_body_is_whole_then_answered_in_anthropics_shape() -> None:
    inner = Recording()
    errors = AnthropicErrors(inner)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(OPENAI_404)).encode())]
    await errors.send({"type": "http.response.start", "status": 404, "headers": head})
    await errors.send({"type": "http.response.body", "body": OPENAI_404[:10], "more_body": True})
    assert inner.sent == []
    assert inner.answered == []
    await errors.send({"type": "http.response.body", "body": OPENAI_404[10:], "more_body": False})
    ((status, headers, body),) = inner.answered
    assert status == 404
    assert orjson.loads(body) == {"type": "error", "error": {"type": "not_found_error", "message": "model: nope"}}
    assert (b"content-length", str(len(body)).encode()) in headers


async def test_a_success_passes_through_untouched() -> None:
    inner = Recording()
    errors = AnthropicErrors(inner)
    start = {"type": "http.response.start", "status": 200, "headers": []}
    body = {"type": "http.response.body", "body": b"event: message_start\n\n", "more_body": True}
    await errors.send(start)
    await errors.send(body)
    assert inner.sent == [start, body]
    await errors.answer(200, [], b"{}")
    assert inner.answered == [(200, [], b"{}")]


async def test_a_failed_streams_error_event_becomes_anthropics() -> None:
    inner = Recording()
    errors = AnthropicErrors(inner)
    failed = b'data: {"error": {"message": "upstream went away", "type": "upstream_error"}}\n\ndata: [DONE]\n\n'
    await errors.send({"type": "http.response.body", "body": failed, "more_body": False})
    (message,) = inner.sent
    assert message["body"].startswith(b"event: error\n")
    assert b"upstream went away" in message["body"]
    assert b"[DONE]" not in message["body"]


async def test_a_whole_error_answer_is_rewritten_and_watching_is_passed_on() -> None:
    inner = Recording()
    errors = AnthropicErrors(inner)
    await errors.answer(429, [(b"retry-after", b"1")], orjson.dumps({"error": {"message": "slow down"}}))
    ((status, headers, body),) = inner.answered
    assert status == 429
    assert orjson.loads(body)["error"] == {"type": "rate_limit_error", "message": "slow down"}
    assert (b"retry-after", b"1") in headers
    errors.watch(lambda: None)
    assert inner.watching
    errors.unwatch()
    assert not inner.watching
