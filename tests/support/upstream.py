"""A scriptable fake OpenAI-compatible upstream for the test suite.

A real HTTP/1.1 server on 127.0.0.1 (raw asyncio protocol + httptools, keep-alive, chunked streaming) with its
own event loop in a background thread, so sync and async tests alike can point a client at `up.url`.

Each request to a model endpoint (`.../chat/completions`, `.../completions`, `.../embeddings`, OpenAI or Azure
`/openai/deployments/{d}/...` paths) takes the next scripted behaviour, or `up.default` once the script is empty.
`GET .../models` gets a model list and consumes nothing; so does `GET /metrics` when `up.metrics` holds a
Prometheus text (a vLLM stand-in's load); other paths get a 404. Every request is recorded, but a WebSocket
upgrade: it gets a 404 (no WebSocket mode here; tests/support/openai_socket.py has one).

`POST .../responses` is the Responses API: the response object, or its event stream (`event:` and `data:`
lines, a `sequence_number` on each), the same bytes for the same request body. Responses it made are kept
(`up.stored`) for `GET/DELETE .../responses/{id}`, `GET .../input_items` and `POST .../cancel`, which
consume nothing from the script.

    with ScriptedUpstream() as up:
        up.script(Status(503), Ok(ttft_ms=50))
        ...
        assert up.requests[-1].json["model"] == "small"

A cold start is `Ok(ttft_ms=...)` scripted first. Async tests wait for a disconnect without blocking their
own loop: `await asyncio.to_thread(up.wait_disconnect)`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json as jsonlib
import re
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar
from urllib.parse import parse_qsl

import httptools


@dataclass(frozen=True)
class Ok:
    """A successful answer, streamed or not as the request's "stream" asks.

    A stream sends its head at once (after `headers_ms`), Azure's empty-choices `prompt_filter_results` chunk if
    `azure_preamble`, the role chunk and the first content chunk at `ttft_ms`, one content chunk every `tpot_ms`,
    the finish chunk, a usage chunk if stream_options.include_usage, then `data: [DONE]`. A non-stream answer
    comes whole after headers_ms + ttft_ms + tpot_ms * (tokens - 1). `text`, if given, is split into words
    that replace the generated tokens.
    """

    ttft_ms: float = 0
    tpot_ms: float = 0
    tokens: int = 5
    text: str | None = None
    headers_ms: float = 0
    azure_preamble: bool = False
    done: ClassVar[bool] = True
    buffered: ClassVar[bool] = False


@dataclass(frozen=True)
class MissingDone(Ok):
    """A clean stream, final zero-length chunk included, that never sends `data: [DONE]`."""

    done: ClassVar[bool] = False


@dataclass(frozen=True)
class Buffered(Ok):
    """A stream held back by a buffering hop: the head at once, then every event in one write at the end."""

    buffered: ClassVar[bool] = True


@dataclass(frozen=True)
class Status:
    """A whole answer with this status; `body` defaults to an OpenAI error. `connection: close` closes after it."""

    code: int
    body: bytes | dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ResetBeforeHeaders:
    """Read the request, then reset the connection (RST) without answering."""


@dataclass(frozen=True)
class ResetMidStream:
    """Send a stream's head and its first `after_chunks` events `tpot_ms` apart, then reset the connection."""

    after_chunks: int = 2
    tpot_ms: float = 10


@dataclass(frozen=True)
class Stall:
    """Never finish: no answer at all, or with `after_chunks=n` a stream's head and first n events, then silence."""

    after_chunks: int | None = None


@dataclass(frozen=True)
class MalformedChunk:
    """A stream whose first HTTP chunk is well framed and whose second has a broken chunk-size line."""


@dataclass(frozen=True)
class Raw:
    """These bytes as the whole answer (not HTTP, a body ended by the close, ...), then close if `close`."""

    data: bytes
    close: bool = True


Behaviour = Ok | Status | ResetBeforeHeaders | ResetMidStream | Stall | MalformedChunk | Raw


@dataclass(frozen=True)
class Recorded:
    """One request as the upstream received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # names in lower case
    body: bytes
    json: Any  # the parsed body, None if it is not JSON
    at: float  # time.monotonic() when the request had been read whole
    connection: int  # 1 for the first connection opened, 2 for the next...


class ScriptedUpstream:
    """The fake upstream; a context manager that starts it on a free port and stops it on exit."""

    _loop: asyncio.AbstractEventLoop  # the server thread's, from __enter__ on

    def __init__(self, default: Behaviour | None = None, port: int = 0) -> None:
        self.default: Behaviour = default if default is not None else Ok()
        self.metrics: str | None = None  # served at GET /metrics when set
        self.requests: list[Recorded] = []
        self.connections_opened = 0
        self.disconnects: list[float] = []  # time.monotonic() of each client close during an answer
        self.stored: dict[str, dict[str, Any]] = {}  # Responses API objects by id
        self.port = 0
        self._wanted_port = port  # 0: a free one
        self._script: deque[Behaviour] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._conns: set[_Connection] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next model requests, one each, in order."""
        with self._cond:
            self._script.extend(behaviours)

    def wait_disconnect(self, timeout: float = 2.0, count: int = 1) -> bool:
        """Whether `count` client disconnects during an answer have happened within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.disconnects) >= count, timeout)

    def close_idle(self) -> int:
        """Close the connections that are not answering, as an upstream's keep-alive timeout does."""
        return asyncio.run_coroutine_threadsafe(self._close_idle(), self._loop).result(5)

    def __enter__(self) -> ScriptedUpstream:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="scripted-upstream", daemon=True)
        self._thread.start()
        ready.wait(5)
        if not self.port:
            raise RuntimeError("scripted upstream did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._thread = None

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            serving = loop.create_server(lambda: _Connection(self), "127.0.0.1", self._wanted_port)
            server = loop.run_until_complete(serving)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown(server))
        finally:
            ready.set()
            loop.close()

    async def _shutdown(self, server: asyncio.Server) -> None:
        server.close()
        current = asyncio.current_task()
        # Connections still being accepted show up as tasks: repeat until nothing is left running.
        while True:
            for conn in list(self._conns):
                conn.stopping = True
                conn.transport.abort()
            tasks = asyncio.all_tasks() - {current}
            if not tasks:
                break
            await asyncio.wait(tasks)
        await server.wait_closed()
        await asyncio.sleep(0)

    async def _close_idle(self) -> int:
        idle = [conn for conn in self._conns if not conn.pending]
        for conn in idle:
            conn.transport.close()
        return len(idle)

    def _next(self) -> Behaviour:
        with self._cond:
            return self._script.popleft() if self._script else self.default

    def _opened(self) -> int:
        with self._cond:
            self.connections_opened += 1
            return self.connections_opened

    def _disconnected(self) -> None:
        with self._cond:
            self.disconnects.append(time.monotonic())
            self._cond.notify_all()


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as they arrive, answered in order by one worker task."""

    transport: asyncio.Transport
    worker: asyncio.Task[None]

    def __init__(self, up: ScriptedUpstream) -> None:
        self.up = up
        self.number = up._opened()
        self.parser = httptools.HttpRequestParser(self)
        self.queue: asyncio.Queue[tuple[Recorded, bool]] = asyncio.Queue()
        self.pending = 0  # requests read and not yet answered whole
        self.stopping = False  # closed by this side: not a client disconnect
        self.writable: asyncio.Future[None] | None = None
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.up._conns.add(self)
        self.worker = self.up._loop.create_task(self._work())

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # answered by on_message_complete
        except httptools.HttpParserError:
            self.stopping = True
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.up._conns.discard(self)
        if self.pending and not self.stopping:
            self.up._disconnected()
        self.worker.cancel()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writable = self.up._loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.headers.get("upgrade", "").lower() == "websocket":
            # No WebSocket mode here (as vLLM): the upgrade is refused, and is not one of the recorded requests.
            self.stopping = True
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()
            return
        url = httptools.parse_url(self.url)
        body = b"".join(self.body)
        request = Recorded(
            method=self.parser.get_method().decode(),
            path=url.path.decode(),
            query=dict(parse_qsl((url.query or b"").decode())),
            headers=self.headers,
            body=body,
            json=_parse_json(body),
            at=time.monotonic(),
            connection=self.number,
        )
        self.up.requests.append(request)  # list.append is atomic: readers in other threads see whole entries
        self.pending += 1
        self.queue.put_nowait((request, self.parser.should_keep_alive()))

    # answering

    async def _work(self) -> None:
        while True:
            request, keep_alive = await self.queue.get()
            keep = await self._answer(request)
            self.pending -= 1
            if not (keep and keep_alive):
                self.stopping = True
                self.transport.close()
                return

    async def _write(self, data: bytes) -> None:
        self.transport.write(data)
        if self.writable is not None:
            await self.writable

    def _reset(self) -> None:
        self.stopping = True
        sock = self.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    async def _answer(self, request: Recorded) -> bool:
        """Answer one request; whether the connection stays open."""
        kind = _kind(request.path)
        if kind is None:
            if "/responses/" in request.path:
                status, answer = _stored(self.up.stored, request)
                await self._write(_json_answer(status, answer))
            elif request.path.endswith("/models"):
                models = {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "tests"}]}
                await self._write(_json_answer(200, models))
            elif request.path == "/metrics" and self.up.metrics is not None:
                text = self.up.metrics.encode()
                await self._write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
                )
            else:
                await self._write(_json_answer(404, _error(404)))
            return True
        behaviour = self.up._next()

        def first(count: int) -> list[bytes]:
            """The first events of a normal stream, for the behaviours that break one off."""
            if kind == "responses":
                return [event for _, event in _response_events(request, Ok(tokens=count + 1), {})[:count]]
            events = _events(request, "completions" if kind == "completions" else "chat", Ok(tokens=count + 1))
            return [event for _, event in events[:count]]

        match behaviour:
            case Ok():
                await self._ok(request, kind, behaviour)
            case Status(code=code, body=body, headers=headers):
                if body is None:
                    body = _error(code)
                await self._write(_json_answer(code, body, headers))
                return headers.get("connection", "").lower() != "close"
            case ResetBeforeHeaders():
                self._reset()
                return False
            case ResetMidStream(after_chunks=count, tpot_ms=gap):
                await self._write(_STREAM_HEAD)
                for i, event in enumerate(first(count)):
                    await _sleep(gap if i else 0)
                    await self._write(_chunk(event))
                await _sleep(gap)
                self._reset()
                return False
            case Stall(after_chunks=count):
                if count is not None:
                    await self._write(_STREAM_HEAD + b"".join(_chunk(event) for event in first(count)))
                await self.up._loop.create_future()  # until the client goes away
            case MalformedChunk():
                await self._write(_STREAM_HEAD + _chunk(first(1)[0]) + b"zz\r\ndata: broken\r\n")
                return False
            case Raw(data=data, close=close):
                await self._write(data)
                return not close
        return True

    async def _ok(self, request: Recorded, kind: str, ok: Ok) -> None:
        await _sleep(ok.headers_ms)
        if kind in ("messages", "count_tokens"):
            await self._messages(request, kind, ok)
            return
        if kind == "responses":
            await self._responses(request, ok)
            return
        if kind == "embeddings" or _body(request).get("stream") is not True:
            await _sleep(ok.ttft_ms + ok.tpot_ms * max(len(_pieces(ok)) - 1, 0))
            await self._write(_json_answer(200, _whole(request, kind, ok)))
            return
        await self._write(_STREAM_HEAD)
        events = _events(request, kind, ok)
        if ok.buffered:
            await _sleep(sum(delay for delay, _ in events))
            await self._write(_chunk(b"".join(event for _, event in events)) + b"0\r\n\r\n")
            return
        for delay, event in events:
            await _sleep(delay)
            await self._write(_chunk(event))
        await self._write(b"0\r\n\r\n")

    async def _messages(self, request: Recorded, kind: str, ok: Ok) -> None:
        """Anthropic's Messages API, as a native backend (llama.cpp, Anthropic) answers it."""
        body = _body(request)
        if kind == "count_tokens":
            await self._write(_json_answer(200, {"input_tokens": _words(body.get("messages")) + 7}))
            return
        pieces = _pieces(ok)
        usage = {"input_tokens": 21, "cache_read_input_tokens": 7, "output_tokens": len(pieces)}
        message: dict[str, Any] = {
            "id": "msg_scripted",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": "".join(pieces)}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
        if body.get("stream") is not True:
            await _sleep(ok.ttft_ms)
            await self._write(_json_answer(200, message))
            return
        # As llama.cpp streams it: the prompt's usage in message_start, the output's alone in message_delta.
        opening = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
        events = [_event("message_start", {"message": opening})]
        events.append(_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        for piece in pieces:
            delta = {"type": "text_delta", "text": piece}
            events.append(_event("content_block_delta", {"index": 0, "delta": delta}))
        events.append(_event("content_block_stop", {"index": 0}))
        final = {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": len(pieces)}}
        events.append(_event("message_delta", final))
        events.append(_event("message_stop", {}))
        await self._write(_STREAM_HEAD)
        for i, event in enumerate(events):
            await _sleep(ok.ttft_ms if i == 1 else ok.tpot_ms if i > 1 else 0)
            await self._write(_chunk(event))
        await self._write(b"0\r\n\r\n")

    async def _responses(self, request: Recorded, ok: Ok) -> None:
        if _body(request).get("stream") is not True:
            await _sleep(ok.ttft_ms + ok.tpot_ms * max(len(_pieces(ok)) - 1, 0))
            await self._write(_json_answer(200, _response_object(request, ok, self.up.stored)))
            return
        await self._write(_STREAM_HEAD)
        for delay, event in _response_events(request, ok, self.up.stored):
            await _sleep(delay)
            await self._write(_chunk(event))
        await self._write(b"0\r\n\r\n")


_PHRASES = {status.value: status.phrase for status in HTTPStatus}
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_FILTERS = {name: {"filtered": False, "severity": "safe"} for name in ("hate", "self_harm", "sexual", "violence")}
_PROMPT_FILTER = [{"prompt_index": 0, "content_filter_results": _FILTERS}]
_AZURE_PREAMBLE = {
    "choices": [],
    "created": 0,
    "id": "",
    "model": "",
    "object": "",
    "prompt_filter_results": _PROMPT_FILTER,
}


async def _sleep(ms: float) -> None:
    if ms > 0:
        await asyncio.sleep(ms / 1000)


def _kind(path: str) -> str | None:
    kinds = (
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/embeddings", "embeddings"),
        ("/responses", "responses"),
        ("/messages", "messages"),
        ("/messages/count_tokens", "count_tokens"),
    )
    for suffix, kind in kinds:
        if path.endswith(suffix):
            return kind
    return None


def _parse_json(body: bytes) -> Any:
    try:
        return jsonlib.loads(body) if body else None
    except ValueError:
        return None


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    """One event of Anthropic's Messages stream."""
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), jsonlib.dumps({"type": kind, **fields}).encode())


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + jsonlib.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error(code: int) -> dict[str, Any]:
    kind = "invalid_request_error" if code < 500 else "server_error"
    return {"error": {"message": f"scripted {code}", "type": kind, "param": None, "code": None}}


def _json_answer(code: int, body: bytes | dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    data = body if isinstance(body, bytes) else jsonlib.dumps(body).encode()
    fields = {"content-type": "application/json", **(headers or {}), "content-length": str(len(data))}
    phrase = _PHRASES.get(code, "Scripted")
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    return f"HTTP/1.1 {code} {phrase}\r\n{head}\r\n".encode("latin-1") + data


def _body(request: Recorded) -> dict[str, Any]:
    return request.json if isinstance(request.json, dict) else {}


def _pieces(ok: Ok) -> list[str]:
    if ok.text is not None:
        return re.findall(r"\s*\S+", ok.text) or [ok.text]
    return [f" tok{i}" if i else "tok0" for i in range(ok.tokens)]


def _words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, dict):
        value = [value.get("content"), value.get("text")]
    return sum(_words(item) for item in value) if isinstance(value, list) else 0


def _base(request: Recorded, ok: Ok, kind: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The fields every payload of one answer shares, and its usage."""
    body = _body(request)
    deployment = re.search(r"/deployments/([^/]+)/", request.path)
    model = body.get("model") or (deployment.group(1) if deployment else "scripted")
    prompt = max(1, _words(body.get("messages") or body.get("prompt") or body.get("input")))
    completion = len(_pieces(ok))
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    ident = f"cmpl-{request.connection}-{int(request.at * 1e6)}"
    return {"id": ident, "object": kind, "created": int(time.time()), "model": model}, usage


def _whole(request: Recorded, kind: str, ok: Ok) -> dict[str, Any]:
    if kind == "embeddings":
        base, usage = _base(request, ok, "list")
        given = _body(request).get("input")
        count = len(given) if isinstance(given, list) and given and not isinstance(given[0], int) else 1
        vectors = [[((i + 1) * (j + 3) % 7) / 7 for j in range(8)] for i in range(count)]
        data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)]
        tokens = {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"]}
        return {"object": "list", "data": data, "model": base["model"], "usage": tokens}
    text = "".join(_pieces(ok))
    if kind == "chat":
        base, usage = _base(request, ok, "chat.completion")
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
    else:
        base, usage = _base(request, ok, "text_completion")
        choice = {"index": 0, "text": text}
    return {**base, "choices": [{**choice, "logprobs": None, "finish_reason": "stop"}], "usage": usage}


def _events(request: Recorded, kind: str, ok: Ok) -> list[tuple[float, bytes]]:
    """The SSE events of a stream, each with the delay in ms before it is sent."""
    chat = kind == "chat"
    base, usage = _base(request, ok, "chat.completion.chunk" if chat else "text_completion")
    with_usage = bool((_body(request).get("stream_options") or {}).get("include_usage"))
    if with_usage:
        base["usage"] = None

    def event(content: str | None, finish: str | None = None) -> bytes:
        if not chat:
            choice: dict[str, Any] = {"index": 0, "text": content or ""}
        else:
            choice = {"index": 0, "delta": {} if content is None else {"content": content}}
        return _sse({**base, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]})

    events: list[tuple[float, bytes]] = [(0, _sse(_AZURE_PREAMBLE))] if ok.azure_preamble else []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        events.append((ok.ttft_ms, _sse({**base, "choices": [role]})))
    for i, piece in enumerate(_pieces(ok)):
        events.append((ok.tpot_ms if i else (0 if chat else ok.ttft_ms), event(piece)))
    events.append((0, event(None, "stop")))
    if with_usage:
        events.append((0, _sse({**base, "choices": [], "usage": usage})))
    if ok.done:
        events.append((0, b"data: [DONE]\n\n"))
    return events


# The Responses API


def _response_object(request: Recorded, ok: Ok, stored: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The whole response to `request` (kept in `stored` unless the body says `store: false`)."""
    body = _body(request)
    digest = hashlib.sha256(request.body).hexdigest()[:24]
    text = "".join(_pieces(ok))
    given = body.get("input")
    prompt = max(1, _words(given if isinstance(given, (str, list)) else []))
    completion = len(_pieces(ok))
    answer = {
        "id": f"resp_{digest}",
        "object": "response",
        "created_at": 1700000000,
        "status": "completed",
        "background": bool(body.get("background")),
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "model": body.get("model") or "scripted",
        "output": [
            {
                "id": f"msg_{digest}",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "annotations": [], "text": text}],
            }
        ],
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature", 1.0),
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }
    if body.get("store") is not False:
        stored[answer["id"]] = {"response": answer, "input": given}
    return answer


def _response_events(request: Recorded, ok: Ok, stored: dict[str, dict[str, Any]]) -> list[tuple[float, bytes]]:
    """A Responses stream's events, each with the delay in ms before it is sent."""
    answer = _response_object(request, ok, stored)
    item = answer["output"][0]
    seq = iter(range(10_000))

    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\n".encode() + _sse(payload)

    opening = {**answer, "status": "in_progress", "output": [], "usage": None}
    at = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    empty = {"type": "output_text", "annotations": [], "text": ""}
    added = {**item, "status": "in_progress", "content": []}
    events = [
        (0.0, event("response.created", response=opening)),
        (0.0, event("response.in_progress", response=opening)),
        (0.0, event("response.output_item.added", output_index=0, item=added)),
        (0.0, event("response.content_part.added", **at, part=empty)),
    ]
    for i, piece in enumerate(_pieces(ok)):
        events.append((ok.tpot_ms if i else ok.ttft_ms, event("response.output_text.delta", **at, delta=piece)))
    text = item["content"][0]["text"]
    events.append((0.0, event("response.output_text.done", **at, text=text)))
    events.append((0.0, event("response.content_part.done", **at, part=item["content"][0])))
    events.append((0.0, event("response.output_item.done", output_index=0, item=item)))
    events.append((0.0, event("response.completed", response=answer)))
    return events


def _stored(stored: dict[str, dict[str, Any]], request: Recorded) -> tuple[int, dict[str, Any]]:
    """GET/DELETE .../responses/{id}, GET .../input_items, POST .../cancel."""
    ident, _, operation = request.path.rpartition("/responses/")[2].partition("/")
    found = stored.get(ident)
    if found is None:
        return 404, {"error": {"message": f"Response with id '{ident}' not found.", "type": "invalid_request_error",
                               "param": None, "code": None}}  # fmt: skip
    answer = found["response"]
    if operation == "input_items":
        given = found["input"]
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
        data = [{"id": f"msg_in_{ident}", **item} for item in (items if isinstance(given, str) else given or [])]
        return 200, {"object": "list", "data": data, "first_id": None, "last_id": None, "has_more": False}
    if operation == "cancel":
        if not answer.get("background"):
            return 400, _error(400)
        answer["status"] = "cancelled"
        return 200, answer
    if request.method == "DELETE":
        del stored[ident]
        return 200, {"id": ident, "object": "response", "deleted": True}
    return 200, answer
