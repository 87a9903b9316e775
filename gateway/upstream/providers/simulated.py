"""The in-process backend (`type: simulated`): scripted answers from `gateway.simulation.answers`, no network.

It lets the quickstart, the demo and the tests run the whole pipeline with realistic timing and nothing
else running. The response plays the script on the event loop: the head at once (as a real server sends its
headers before the first token), each piece when it is due.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from gateway.simulation.answers import Profile, Reply, error_reply, json_reply, simulate
from gateway.upstream.connection import ResponseClosed, read_all
from gateway.upstream.health import Health
from gateway.wire import response_events

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from gateway.context import Exchange, Target


class SimulatedResponse:
    """One scripted answer; piece i is returned no sooner than `ttft_s + i * tpot_s` after it was made."""

    __slots__ = (
        "_closed",
        "_index",
        "_loop",
        "_reply",
        "_start",
        "_waiter",
        "acquire_ms",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, reply: Reply, request_id: str) -> None:
        self._reply = reply
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self._index = 0
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self.status = reply.status
        self.headers = [(b"content-type", reply.content_type), (b"x-request-id", request_id.encode("latin-1"))]
        self.complete = False
        self.acquire_ms = 0.0  # no connection to get

    async def next_chunk(self) -> bytes:
        """The next piece once it is due, b"" after the last one."""
        if self._closed:
            raise ResponseClosed("response closed")
        reply = self._reply
        if self._index >= len(reply.pieces):
            return b""
        delay = self._start + reply.ttft_s + self._index * reply.tpot_s - self._loop.time()
        if delay > 0:
            await self._sleep(delay)
            if self._closed:
                raise ResponseClosed("response closed")
        piece = reply.pieces[self._index]
        self._index += 1
        self.complete = self._index == len(reply.pieces)
        return piece

    async def read(self) -> bytes:
        """The whole body."""
        return await read_all(self.next_chunk)

    def close(self) -> None:
        """Stop: a reader waiting for the next piece wakes up and gets ResponseClosed."""
        self._closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep(self, delay: float) -> None:
        # A future rather than asyncio.sleep, so that close() from another task wakes the reader.
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(delay, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


# Stored responses kept for retrieval (the API's `store`), newest last; the oldest go first.
STORED_RESPONSES = 1024


class SimulatedProvider:
    kind: ClassVar[str] = "simulated"
    system: ClassVar[str] = "openai"
    reports_usage = True
    usage_of_first_choice = False

    url = None  # in-process: no address

    def __init__(self, profile: Profile, name: str = "simulated") -> None:
        self.profile = profile
        self.health = Health(name)
        self.health.in_process = True
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[Any]]] = OrderedDict()

    async def start(self) -> None:
        self.health.mark_up()  # in-process: nothing to connect to

    @property
    def ready(self) -> bool:
        return True

    async def send(self, ex: Exchange, target: Target) -> SimulatedResponse:
        """Script the answer; the head is ready at once, the pieces come from `next_chunk()` when due."""
        if ex.resource:
            return SimulatedResponse(self._stored(ex.method, ex.resource), ex.request_id)
        # Streams report usage as an upstream asked for it does: the relay hides it if the client did not ask.
        reply = simulate(ex.endpoint, ex.json, target.upstream_model, self.profile, usage=True)
        if ex.endpoint == "responses" and reply.status == 200 and ex.json.get("store") is not False:
            self._remember(reply, ex.json.get("input"))
        return SimulatedResponse(reply, ex.request_id)

    def _remember(self, reply: Reply, given: Any) -> None:
        response = response_events.assemble(reply.pieces[-1]) if reply.stream else orjson.loads(reply.pieces[0])
        if response is None:
            return
        if isinstance(given, str):
            given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
        items = [
            {"id": f"msg_{response['id'][5:]}{i}", **item} if isinstance(item, dict) else item
            for i, item in enumerate(given or [])
        ]
        self.stored[response["id"]] = (response, items)
        if len(self.stored) > STORED_RESPONSES:
            self.stored.popitem(last=False)

    def _stored(self, method: bytes, resource: str) -> Reply:
        """GET/DELETE /responses/{id}, GET .../input_items, POST .../cancel on what this backend stored."""
        path, _, query = resource.partition("?")
        ident, _, operation = path.strip("/").partition("/")
        found = self.stored.get(ident)
        if found is None:
            return error_reply(404, f"Response with id '{ident}' not found.")
        response, items = found
        if operation == "input_items":
            first, last = (items[0].get("id"), items[-1].get("id")) if items else (None, None)
            page = {"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": False}
            return json_reply(200, page)
        if operation == "cancel":
            return error_reply(400, "Only responses created with background mode can be cancelled.")
        if method == b"DELETE":
            del self.stored[ident]
            return json_reply(200, {"id": ident, "object": "response", "deleted": True})
        if "stream=true" in query:
            after = -1
            for pair in query.split("&"):
                name, _, value = pair.partition("=")
                if name == "starting_after" and value.lstrip("-").isdigit():
                    after = int(value)
            events = [e for group in response_events.stream_events(response) for e in group]
            body = b"".join(response_events.sse(e) for e in events if e["sequence_number"] > after)
            return Reply(200, b"text/event-stream", [body], 0.0, 0.0)
        return json_reply(200, response)

    def report(self) -> dict[str, Any]:
        return self.health.report()

    def instrument(self, gauge: Gauge) -> None:
        return None  # no endpoints: in-process

    def in_service(self) -> int:
        return 1

    def endpoint_urls(self) -> list[str]:
        return []

    async def aclose(self) -> None:
        return None
