"""The pipeline's steps 2 to 6 on a built Exchange, answered through a recording responder.

The upstream is a scripted one at the provider boundary (what a backend's response looks like to the attempt
loop: a head, then pieces, or a failure), so that each path through the pipeline is driven on purpose: an
upstream answer whole and streamed, a plugin's reply, a rejection, a failure before the first byte (rescued by
a plugin or not) and after it, a client that leaves, and an operation on a stored object dispatched without
the attempt loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import orjson
import pytest

from gateway import errors
from gateway.config import parse as parse_config
from gateway.context import Exchange, Target
from gateway.pipeline import Pipeline
from gateway.plugin import Outcome, Reply, ResponseHead, Schema
from gateway.server import request
from gateway.server.reply import BODY_FOLLOWS
from gateway.upstream.attempts import Opened, Upstreams
from gateway.upstream.connection import ResponseClosed
from gateway.upstream.health import Health

CONFIG = """
backends:
  sim: {type: simulated}
models:
  chat: {backend: sim, max_attempts: 1}
plugins: []
"""
ANSWER = orjson.dumps(
    {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant"}}]}
)
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


class Recording:
    """A responder that keeps what the pipeline sent, and can say the client left."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.answers: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = []
        self.gone: Callable[[], None] | None = None
        self.watched = 0

    async def send(self, message: Any) -> None:
        self.messages.append(message)

    async def answer(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        self.answers.append((status, list(headers), body))

    def watch(self, gone: Callable[[], None]) -> None:
        self.gone = gone
        self.watched += 1

    def unwatch(self) -> None:
        self.gone = None

    def leave(self) -> None:
        if self.gone is not None:
            self.gone()

    @property
    def streamed(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


class Scripted:
    """An upstream response that plays `pieces`; a piece that is an exception is raised when its turn comes."""

    acquire_ms = 0.0

    def __init__(self, status: int, pieces: list[bytes | Exception], hold: asyncio.Event | None = None) -> None:
        self.status = status
        self.headers = [(b"content-type", b"application/json"), (b"x-request-id", b"up-1")]
        self.pieces = pieces
        self.complete = False
        self.closed = False
        self.hold = hold
        self.waiting = asyncio.Event()

    async def next_chunk(self) -> bytes:
        if self.hold is not None:
            self.waiting.set()
            await self.hold.wait()
        if not self.pieces:
            self.complete = True
            return b""
        piece = self.pieces.pop(0)
        if isinstance(piece, Exception):
            raise piece
        return piece

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        self.closed = True


class Backend:
    """A provider at the boundary: each send answers with the next scripted response."""

    kind: ClassVar[str] = "scripted"
    system: ClassVar[str] = "scripted"
    reports_usage = True
    usage_of_first_choice = False
    url = None

    def __init__(self, *responses: Scripted | Exception) -> None:
        self.responses = list(responses)
        self.health = Health("scripted")
        self.sent: list[Exchange] = []

    async def send(self, ex: Exchange, target: Target) -> Scripted:
        self.sent.append(ex)
        response = self.responses.pop(0)
        if isinstance(response, Exception):
            raise response
        return response


class Listener:
    """A plugin that records what it heard, and may answer, reject or rescue as a test asks."""

    name: ClassVar[str] = "listener"
    schema: ClassVar[Schema] = Schema()

    def __init__(self, reply: Reply | None = None, reject: errors.GatewayError | None = None) -> None:
        self.reply = reply
        self.reject = reject
        self.rescue: Reply | None = None
        self.completed: list[Outcome] = []
        self.heads: list[ResponseHead] = []
        self.tapped: list[bytes] = []

    async def on_request(self, ex: Exchange) -> Reply | None:
        if self.reject is not None:
            raise self.reject
        return self.reply

    async def on_failure(self, ex: Exchange, error: errors.GatewayError) -> Reply | None:
        return self.rescue

    async def on_response(self, ex: Exchange, head: ResponseHead) -> Callable[[bytes], None]:
        self.heads.append(head)
        head.headers.append((b"x-listener", b"1"))
        return self.tapped.append

    async def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        self.completed.append(outcome)


def build(
    backend: Backend, listener: Listener | None = None, dispatch: Any = None
) -> tuple[Pipeline, Upstreams, Target]:
    settings = parse_config(CONFIG, "test")
    upstreams = Upstreams(settings)
    spec = upstreams.targets["chat"].settings
    target = Target("chat", "sim", "chat", spec, backend)  # type: ignore[arg-type]
    plugins: list[Any] = [listener] if listener is not None else []
    return Pipeline(settings, upstreams, plugins, None, dispatch=dispatch), upstreams, target


def exchange(target: Target, stream: bool = False) -> Exchange:
    body: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    ex = request.parse("chat/completions", [], orjson.dumps(body), 0.0, "rid-1")
    ex.targets = [target]
    return ex


def serve(pipeline: Pipeline, ex: Exchange, responder: Recording) -> None:
    asyncio.run(pipeline.serve(ex, responder))


def headers_of(pairs: Sequence[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    return dict(pairs)


def test_a_whole_upstream_answer_leaves_in_one_call_with_the_gateway_headers() -> None:
    listener = Listener()
    backend = Backend(Scripted(200, [ANSWER[:-1] + b',"usage":' + orjson.dumps(USAGE) + b"}"]))
    pipeline, _, target = build(backend, listener)
    responder = Recording()
    serve(pipeline, exchange(target), responder)
    assert not responder.messages
    [(status, pairs, body)] = responder.answers
    seen = headers_of(pairs)
    assert status == 200
    assert orjson.loads(body)["id"] == "c1"
    assert seen[b"x-request-id"] == b"rid-1"
    assert seen[b"x-upstream-request-id"] == b"up-1"
    assert seen[b"x-sluice-model"] == b"chat"
    assert seen[b"x-listener"] == b"1"
    assert seen[b"content-length"] == str(len(body)).encode()
    assert b"server-timing" in seen
    [outcome] = listener.completed
    assert outcome.complete
    assert outcome.status == 200
    assert outcome.usage == USAGE
    assert listener.tapped == [body, b""]
    assert responder.watched == 1
    assert responder.gone is None
    assert pipeline.inflight == 0


def test_a_stream_is_relayed_piece_by_piece_and_ends_complete() -> None:
    events = [b'data: {"choices":[{"delta":{"content":"o"}}]}\n\n', b'data: {"choices":[{"delta":{}}]}\n\n']
    listener = Listener()
    pipeline, _, target = build(Backend(Scripted(200, [*events, b"data: [DONE]\n\n"])), listener)
    responder = Recording()
    serve(pipeline, exchange(target, stream=True), responder)
    start = responder.messages[0]
    assert start["type"] == "http.response.start"
    assert start[BODY_FOLLOWS]
    assert headers_of(start["headers"])[b"cache-control"] == b"no-cache"
    assert responder.streamed == b"".join(events) + b"data: [DONE]\n\n"
    assert responder.messages[-1]["more_body"] is False
    [outcome] = listener.completed
    assert outcome.complete
    assert outcome.ttft_ms is not None


def test_a_plugin_reply_answers_without_an_upstream() -> None:
    backend = Backend()
    listener = Listener(reply=Reply(200, [(b"content-type", b"application/json")], b"{}", source="listener"))
    pipeline, _, target = build(backend, listener)
    responder = Recording()
    serve(pipeline, exchange(target), responder)
    assert responder.answers[0][0] == 200
    assert responder.answers[0][2] == b"{}"
    assert backend.sent == []
    assert listener.completed[0].source == "listener"
    assert listener.completed[0].ttft_ms is not None


def test_a_rejection_is_an_openai_error_marked_with_the_plugin() -> None:
    backend = Backend()
    listener = Listener(reject=errors.RateLimitError("slow down", headers=[(b"retry-after", b"1")]))
    pipeline, _, target = build(backend, listener)
    responder = Recording()
    ex = exchange(target)
    serve(pipeline, ex, responder)
    [(status, pairs, body)] = responder.answers
    assert status == 429
    assert headers_of(pairs)[b"retry-after"] == b"1"
    assert set(orjson.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert ex.rejected_by == "listener"
    assert backend.sent == []
    assert listener.completed[0].status == 429


@pytest.mark.parametrize("rescued", [False, True])
def test_a_failure_before_the_first_byte_is_an_error_or_a_plugins_rescue(rescued: bool) -> None:
    listener = Listener()
    if rescued:
        listener.rescue = Reply(status=200, headers=[(b"content-type", b"application/json")], body=b'{"stale":1}')
    pipeline, _, target = build(Backend(Scripted(503, [b'{"error":{"message":"busy"}}'])), listener)
    responder = Recording()
    serve(pipeline, exchange(target), responder)
    [(status, _, body)] = responder.answers
    if rescued:
        assert (status, body) == (200, b'{"stale":1}')
    else:
        assert status == 503
        assert orjson.loads(body)["error"]["message"]
        assert listener.completed[0].error


def test_a_failure_after_the_first_byte_ends_the_stream_with_an_error_event() -> None:
    first = b'data: {"choices":[{"delta":{"content":"o"}}]}\n\n'
    listener = Listener()
    scripted = Scripted(200, [first, ResponseClosed("connection reset")])
    pipeline, _, target = build(Backend(scripted), listener)
    responder = Recording()
    serve(pipeline, exchange(target, stream=True), responder)
    assert responder.messages[0]["status"] == 200  # the head went out with the first chunk
    assert responder.streamed.startswith(first)
    assert b'"error"' in responder.streamed.removeprefix(first)
    assert responder.messages[-1]["more_body"] is False
    assert scripted.closed
    [outcome] = listener.completed
    assert not outcome.complete
    assert outcome.error


def test_a_client_that_leaves_stops_the_upstream_at_once() -> None:
    hold = asyncio.Event()
    listener = Listener()
    scripted = Scripted(200, [b"data: [DONE]\n\n"], hold)
    pipeline, _, target = build(Backend(scripted), listener)
    responder = Recording()

    async def run() -> None:
        task = asyncio.create_task(pipeline.serve(exchange(target, stream=True), responder))
        await asyncio.wait_for(scripted.waiting.wait(), 5)  # the upstream's head is in: its first chunk is awaited
        responder.leave()
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert scripted.closed
    [outcome] = listener.completed
    assert outcome.client_gone
    assert outcome.error == "client disconnected"
    assert pipeline.inflight == 0


def test_a_stored_object_goes_to_dispatch_never_to_the_attempt_loop() -> None:
    backend = Backend()
    dispatched: list[Exchange] = []

    async def dispatch(ex: Exchange) -> Opened:
        dispatched.append(ex)
        ex.served = target
        return Opened(Scripted(200, []), b'{"id":"resp_1"}')

    listener = Listener()
    pipeline, _, target = build(backend, listener, dispatch)
    ex = Exchange("rid-2", "responses", [], b"", {"model": ""}, 0.0)
    ex.method, ex.resource = b"GET", "/resp_1"
    responder = Recording()
    serve(pipeline, ex, responder)
    assert dispatched == [ex]
    assert backend.sent == []
    assert responder.answers[0][0] == 200
    assert responder.answers[0][2] == b'{"id":"resp_1"}'
    assert listener.completed[0].usage is None  # a stored response's tokens were counted when it was made
