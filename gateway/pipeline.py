"""The request path: the only module with request control flow. Six steps, one direction.

    1 parse     ASGI request -> Exchange (request.py), targets = the model's chain
    2 request   plugins' on_request in config order; a Reply answers now, a GatewayError rejects
    3 upstream  upstream.open(): targets tried in order until one gives its first chunk; if none does,
                plugins' on_failure may still answer (a stale cache entry) before the error goes out
    4 response  head known, nothing sent: plugins' on_response may add headers or a tap
    5 body      the relay (streaming.py), or the whole body / the plugin's reply
    6 complete  plugins' on_complete, scheduled after the last byte: never delays the client

A rejection and a plugin's reply go through steps 4 to 6 like an upstream answer, so headers and
accounting look the same on every path. A client that disconnects cancels whatever is in flight: the
upstream request is closed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from gateway import errors, request
from gateway.plugin import Outcome, Reply, ResponseHead, Tap, hooks
from gateway.streaming import find_usage, relay_stream
from gateway.telemetry import server_timing

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Plugin
    from gateway.settings import Settings
    from gateway.telemetry import Telemetry
    from gateway.upstream import Opened, Upstreams

log = logging.getLogger("sluice")

# Upstream response headers worth passing on; everything else is hop-by-hop or the gateway's to set.
PASSED = frozenset({b"content-type", b"openai-processing-ms", b"openai-version", b"apim-request-id", b"x-ms-region"})
JSON = (b"content-type", b"application/json")
STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))
WATCH_AFTER_S = 0.05


class Pipeline:
    def __init__(
        self, settings: Settings, upstreams: Upstreams, plugins: list[Plugin], telemetry: Telemetry | None = None
    ) -> None:
        self.upstreams = upstreams
        self.telemetry = telemetry
        self.chains = upstreams.chains
        self.max_body = settings.limits.max_body_bytes
        self.on_request = hooks(plugins, "on_request")
        self.on_failure = hooks(plugins, "on_failure")
        self.on_response = hooks(plugins, "on_response")
        self.on_complete = hooks(plugins, "on_complete")
        self._background: set[asyncio.Task[None]] = set()

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, endpoint: str, path_model: str | None = None
    ) -> None:
        started = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        try:
            body = await request.read_body(receive, headers, self.max_body)
            ex = request.parse(endpoint, headers, body, started, rid, path_model)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self._reject(send, exc, rid)
            return
        ex.mark("parse", started)
        chain = self.chains.get(ex.model)
        if chain is None:
            await self._reject(send, errors.NotFoundError(f"The model `{ex.model}` does not exist", param="model"), rid)
            return
        ex.targets = list(chain)
        if self.telemetry is not None:
            self.telemetry.begin(ex)  # in flight from here; sets the traceparent the upstream gets
        await self._serve(ex, receive, send)

    async def _reject(self, send: Send, error: errors.GatewayError, rid: str) -> None:
        if self.telemetry is not None:
            self.telemetry.rejected(error.status)
        await send_error(send, error, rid)

    async def _serve(self, ex: Exchange, receive: Receive, send: Send) -> None:
        outcome = Outcome(status=0)
        task = asyncio.current_task()
        assert task is not None
        done = False

        def client_left(_: asyncio.Future[Any]) -> None:
            if not done:
                outcome.client_gone = True
                task.cancel()

        # uvicorn reports a disconnect only through receive(): watch it so that a client that leaves stops
        # the upstream at once, whether we are waiting for the first token or relaying. The watcher starts
        # only once a request has lasted WATCH_AFTER_S: most non-stream answers are done by then, and a
        # client gone sooner loses nothing but those milliseconds of upstream work.
        loop = asyncio.get_running_loop()
        watcher: asyncio.Future[Any] | None = None

        def watch() -> None:
            nonlocal watcher
            if not done:
                watcher = asyncio.ensure_future(receive())
                watcher.add_done_callback(client_left)

        timer = loop.call_later(WATCH_AFTER_S, watch)
        try:
            await self._respond(ex, send, outcome)
        except asyncio.CancelledError:
            if not outcome.client_gone:
                raise
            task.uncancel()
            outcome.error = outcome.error or "client disconnected"
        finally:
            done = True
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
            if outcome.ttft_ms is None and outcome.complete and (not ex.stream or outcome.source != "upstream"):
                outcome.ttft_ms = outcome.total_ms  # a whole answer, or a plugin's: its first token came with it
            # Plugins hear of every request that reached them, however it ended (a leader that fails
            # must still release the requests following it).
            if self.on_complete:
                job = loop.create_task(self._complete(ex, outcome))
                self._background.add(job)
                job.add_done_callback(self._background.discard)
            elif self.telemetry is not None:
                loop.call_soon(self._record, ex, outcome)  # synchronous: no task needed

    async def _respond(self, ex: Exchange, send: Send, outcome: Outcome) -> None:
        reply: Reply | None = None
        opened: Opened | None = None
        try:
            for name, hook in self.on_request:
                since = time.perf_counter()
                try:
                    reply = await hook(ex)
                except errors.GatewayError:
                    ex.rejected_by = name
                    raise
                finally:
                    ex.mark(name, since)
                if reply is not None:
                    break
            if reply is None:
                try:
                    opened = await self.upstreams.open(ex)
                except errors.GatewayError as exc:
                    reply = await self._rescue(ex, exc)
                    if reply is None:
                        raise
                finally:
                    if ex.routed is not None:  # a backend with several endpoints chose one: the gateway's time
                        ex.upstream_ms -= ex.route_ms
                        ex.timings.append(("route", ex.route_ms))
                    if ex.served is not None:  # the wait for a connection, of the attempt that served
                        ex.timings.append(("pool", ex.pool_ms))
                    ex.timings.append(("upstream", ex.upstream_ms - ex.pool_ms))
        except errors.GatewayError as exc:
            outcome.error = exc.message
            reply = Reply(status=exc.status, headers=[JSON, *exc.headers], body=exc.body(), source="error")
        except Exception as exc:
            # A bug in a plugin or here must still get an answer in the client's format, and a log line.
            log.exception("request %s failed inside the gateway", ex.request_id)
            error = errors.GatewayError(f"internal gateway error ({type(exc).__name__})", code="internal_error")
            outcome.error = error.message
            reply = Reply(status=500, headers=[JSON], body=error.body(), source="error")

        # Step 4: the head.
        if opened is not None:
            response = opened.response
            status = response.status
            head_headers = []
            for key, value in response.headers:
                if key in PASSED:
                    head_headers.append((key, value))
                elif key == b"x-request-id":
                    head_headers.append((b"x-upstream-request-id", value))
            if ex.stream:
                head_headers.extend(STREAM_HEADERS)
        else:
            assert reply is not None
            status = reply.status
            head_headers = list(reply.headers)
            outcome.source = reply.source
            if reply.stream is not None:
                head_headers.extend(STREAM_HEADERS)
        head_headers.append((b"x-request-id", ex.request_id.encode()))
        if ex.served is not None:
            head_headers.append((b"x-sluice-model", ex.served.model.encode()))
        if ex.fallback is not None:
            head_headers.append((b"x-sluice-fallback", ex.fallback.encode()))
        head = ResponseHead(status, head_headers)
        outcome.status = status
        taps: list[Tap] = []
        for _, hook in self.on_response:
            tap = await hook(ex, head)
            if tap is not None:
                taps.append(tap)
        now = time.perf_counter()
        overhead = ex.overhead_ms = (now - ex.started) * 1000.0 - ex.upstream_ms
        head.headers.append((b"server-timing", server_timing(ex.timings, overhead)))
        head.headers.append((b"x-sluice-overhead-ms", f"{overhead:.3f}".encode()))

        # Step 5: the body.
        if opened is not None and ex.stream:
            try:
                await send({"type": "http.response.start", "status": status, "headers": head.headers})
                await relay_stream(
                    send, opened.response, opened.first, outcome, tuple(taps), ex.started, opened.token_at
                )
            finally:
                opened.response.close()
        else:
            await self._send_whole(send, head, opened, reply, outcome, tuple(taps))
        outcome.total_ms = (time.perf_counter() - ex.started) * 1000.0

    async def _rescue(self, ex: Exchange, error: errors.GatewayError) -> Reply | None:
        """Every target failed: a plugin may still answer (a stale cache entry) before the error goes out."""
        for _, hook in self.on_failure:
            reply: Reply | None = await hook(ex, error)
            if reply is not None:
                return reply
        return None

    async def _send_whole(
        self,
        send: Send,
        head: ResponseHead,
        opened: Opened | None,
        reply: Reply | None,
        outcome: Outcome,
        taps: tuple[Tap, ...],
    ) -> None:
        if reply is not None and reply.stream is not None:
            await send({"type": "http.response.start", "status": head.status, "headers": head.headers})
            async for piece in reply.stream:
                for tap in taps:
                    tap(piece)
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome.complete = True
            return
        body = opened.first if opened is not None else reply.body if reply is not None else b""
        head.headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": head.status, "headers": head.headers})
        for tap in taps:
            tap(body)
            tap(b"")
        await send({"type": "http.response.body", "body": body, "more_body": False})
        outcome.complete = True
        if opened is not None and head.status < 400:
            outcome.usage = find_usage(body[-2048:])

    def _record(self, ex: Exchange, outcome: Outcome) -> None:
        assert self.telemetry is not None
        try:
            self.telemetry.complete(ex, outcome)
        except Exception:
            log.exception("telemetry failed")

    async def _complete(self, ex: Exchange, outcome: Outcome) -> None:
        if self.telemetry is not None:
            self._record(ex, outcome)
        for name, hook in self.on_complete:
            try:
                await hook(ex, outcome)
            except Exception:
                log.exception("plugin %s: on_complete failed", name)


async def send_error(send: Send, exc: errors.GatewayError, rid: str) -> None:
    body = exc.body()
    headers = [JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode()), *exc.headers]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
