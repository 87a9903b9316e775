"""A fake OpenAI Responses upstream that speaks the WebSocket mode as well as HTTP/SSE.

A real server on 127.0.0.1 (asyncio, its own loop in a background thread; or a process of its own with
`python -m tests.support.openai_socket --port N`, as `sluice bench --scenario websocket` runs it):
- `GET .../responses` with `Upgrade: websocket`: OpenAI's WebSocket mode (wsproto's server side). Each
  `response.create` text message is answered with the response's events, one JSON text message each. A
  `previous_response_id` is found in the connection's own last response (its connection-local cache) or among
  stored responses (`store` not false), else the turn gets OpenAI's error event `previous_response_not_found`.
- `POST .../responses` (`stream: true`): the same events as SSE, chunked, on a keep-alive connection.
- `GET .../models`: a one-model list (a readiness probe); `GET /stats`: how many sockets, creates on them and
  HTTP creates it served (for a benchmark running it as a process).

Timing: the first delta `ttft_ms` after the create, then one every `tpot_ms`. What tests look at: `sockets` (each
upgrade: its headers and the creates it carried), `posts` (each HTTP create: its headers and body). What tests
change: `refuse_upgrade` (an HTTP status answered to every upgrade), `drop_next` (the next WebSocket turn's socket
is closed after its first event), `evict_next` (the next WebSocket turn finds its socket's cache empty), `fail_next`
(the next WebSocket turn gets an error event with this status, and nothing else).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, RejectConnection, Request, TextMessage


@dataclass
class Socket:
    """One upgrade the fake accepted: its handshake's headers and every create it carried."""

    headers: dict[str, str]
    creates: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False


@dataclass
class Post:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def response_events(body: dict[str, Any], ident: str, tokens: int) -> list[dict[str, Any]]:
    """A response's events as OpenAI streams them (sequence numbers added when sent)."""
    model = body.get("model")
    base = {"id": ident, "object": "response", "model": model, "previous_response_id": body.get("previous_response_id")}
    item_id = "msg_" + secrets.token_hex(8)
    words = [f"w{i} " for i in range(tokens)]
    text = "".join(words)
    done_item = {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    given = body.get("input")
    input_tokens = len(orjson.dumps(given)) // 4 if given is not None else 0
    usage = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + tokens,
    }
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**base, "status": "in_progress", "output": []}},
        {"type": "response.in_progress", "response": {**base, "status": "in_progress", "output": []}},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**done_item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **at, "part": {"type": "output_text", "text": "", "annotations": []}},
    ]
    events += [{"type": "response.output_text.delta", **at, "delta": word} for word in words]
    events += [
        {"type": "response.output_text.done", **at, "text": text},
        {"type": "response.content_part.done", **at, "part": done_item["content"][0]},
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {
            "type": "response.completed",
            "response": {**base, "status": "completed", "output": [done_item], "usage": usage},
        },
    ]
    return events


class FakeOpenAI:
    """The server (see the module's docstring); a context manager that runs it in a thread."""

    def __init__(self, ttft_ms: float = 5, tpot_ms: float = 1, tokens: int = 4) -> None:
        self.ttft_s = ttft_ms / 1000.0
        self.tpot_s = tpot_ms / 1000.0
        self.tokens = tokens
        self.sockets: list[Socket] = []
        self.posts: list[Post] = []
        self.stored: set[str] = set()
        self.refuse_upgrade: int | None = None
        self.drop_next = False
        self.evict_next = False
        self.fail_next: int | None = None
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self, port: int = 0) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    def __enter__(self) -> FakeOpenAI:
        started = threading.Event()

        def run() -> None:
            async def main() -> None:
                await self.start()
                started.set()
                assert self.server is not None
                async with self.server:
                    await self.server.serve_forever()

            with contextlib.suppress(asyncio.CancelledError):
                asyncio.run(main())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not started.wait(10):
            raise RuntimeError("the fake OpenAI upstream did not start")
        return self

    def __exit__(self, *_: object) -> None:
        if self.loop is not None and self.server is not None:
            # One call into the loop's own thread does the closing: the tasks are listed there (a list taken from
            # this thread races the loop), and a loop that has already finished and closed needs nothing more.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._stop)
        if self.thread is not None:
            self.thread.join(10)

    def _stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in asyncio.all_tasks():
            task.cancel()

    # One connection: HTTP requests on keep-alive, or an upgrade

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *rest = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)}
                if headers.get("upgrade", "").lower() == "websocket":
                    await self._upgrade(head, path, headers, reader, writer)
                    return
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                await self._http(method, path, headers, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _http(self, method: str, path: str, headers: dict[str, str], body: bytes, writer: Any) -> None:
        if method == "GET" and (path.endswith("/models") or path == "/stats"):
            if path == "/stats":  # what a benchmark in another process checks: how its turns came
                found: dict[str, Any] = {
                    "sockets": len(self.sockets),
                    "socket_creates": sum(len(s.creates) for s in self.sockets),
                }
                found["posts"] = len(self.posts)
                payload = orjson.dumps(found)
            else:
                payload = orjson.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]})
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            writer.write(head % len(payload))
            writer.write(payload)
            return
        if method != "POST" or not path.split("?")[0].endswith("/responses"):
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        create = orjson.loads(body)
        self.posts.append(Post(path, headers, create))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        async for event in self._turn(create, None):
            data = b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async def _turn(self, create: dict[str, Any], cache: list[str | None] | None) -> Any:
        """A create's events, when due; `cache` is a socket's last response (None over HTTP)."""
        started = asyncio.get_running_loop().time()
        previous = create.get("previous_response_id")
        if previous is not None and previous not in self.stored and (cache is None or cache[0] != previous):
            yield {
                "type": "error",
                "status": 400,
                "error": {
                    "type": "invalid_request_error",
                    "code": "previous_response_not_found",
                    "message": f"Previous response with id '{previous}' not found.",
                    "param": "previous_response_id",
                },
            }
            return
        ident = "resp_" + secrets.token_hex(12)
        if create.get("store") is not False:
            self.stored.add(ident)
        if cache is not None:
            cache[0] = ident
        deltas = 0
        for number, event in enumerate(response_events(create, ident, self.tokens)):
            if event["type"] == "response.output_text.delta":
                due = started + self.ttft_s + deltas * self.tpot_s
                deltas += 1
                delay = due - asyncio.get_running_loop().time()
                if delay > 0:
                    await asyncio.sleep(delay)
            yield {**event, "sequence_number": number}

    async def _upgrade(self, head: bytes, path: str, headers: dict[str, str], reader: Any, writer: Any) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        ws.receive_data(head)
        request = next(event for event in ws.events() if isinstance(event, Request))
        if self.refuse_upgrade is not None or not path.split("?")[0].endswith("/responses"):
            status = self.refuse_upgrade or 404
            writer.write(ws.send(RejectConnection(status_code=status, headers=[(b"content-length", b"0")])))
            await writer.drain()
            return
        del request
        socket = Socket(headers)
        self.sockets.append(socket)
        writer.write(ws.send(AcceptConnection()))
        cache: list[str | None] = [None]
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Ping):
                        writer.write(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        writer.write(ws.send(event.response()))
                        return
                    elif isinstance(event, TextMessage):
                        create = orjson.loads(event.data)
                        socket.creates.append(create)
                        if not await self._socket_turn(ws, writer, create, cache):
                            return
        finally:
            socket.closed = True

    async def _socket_turn(
        self, ws: WSConnection, writer: Any, create: dict[str, Any], cache: list[str | None]
    ) -> bool:
        """One create over the socket; False when the socket was dropped on purpose."""
        drop, self.drop_next = self.drop_next, False
        fail, self.fail_next = self.fail_next, None
        if fail is not None:
            event = {"type": "error", "status": fail, "error": {"type": "server_error", "message": "overloaded"}}
            writer.write(ws.send(TextMessage(data=orjson.dumps(event).decode())))
            return True
        if self.evict_next:
            self.evict_next = False
            cache[0] = None
        async for event in self._turn(create, cache):
            writer.write(ws.send(TextMessage(data=orjson.dumps(event).decode())))
            await writer.drain()
            if drop:
                writer.transport.abort()
                return False
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake OpenAI Responses upstream with the WebSocket mode.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=20)
    parser.add_argument("--tpot-ms", type=float, default=1)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    fake = FakeOpenAI(args.ttft_ms, args.tpot_ms, args.tokens)

    async def run() -> None:
        await fake.start(args.port)
        assert fake.server is not None
        async with fake.server:
            await fake.server.serve_forever()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


if __name__ == "__main__":
    main()
