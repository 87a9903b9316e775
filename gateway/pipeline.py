"""The request path: the only module with request control flow. Six steps, one direction.

    1 parse     request -> Exchange (server/request.py), from the protocol (server/direct.py) or from ASGI;
                targets = the model's chain, which the routing step (`route`, set by the runtime: the
                Responses API, background jobs) may replace
    2 request   plugins' on_request in config order; a Reply answers now, a GatewayError rejects; then
                for the Responses API and stored objects, the admission step (`admit`, set by the runtime):
                the owner of what the request reads or references, checked against its tenant
    3 upstream  upstream.open(): targets tried in order until one gives its first chunk; if none does,
                plugins' on_failure may still answer (a stale cache entry) before the error goes out
    4 response  head known, nothing sent: plugins' on_response may add headers or a tap
    5 body      the relay (server/relay.py), or the whole body / the plugin's reply
    6 complete  plugins' on_complete, after the last byte: never delays the client

A rejection and a plugin's reply go through steps 4 to 6 like an upstream answer, so headers and
accounting look the same on every path. A client that disconnects cancels whatever is in flight: the
upstream request is closed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.plugin import Outcome, Reply, ResponseHead, Tap, hooks
from gateway.server import request
from gateway.server.relay import all_choices_usage, find_usage, relay_stream, usage_mode
from gateway.server.reply import BODY_FOLLOWS, JSON, send_error
from gateway.telemetry.recorder import ms_value, server_timing
from gateway.upstream.attempts import Opened, around_loading
from gateway.wire.marks import stream_rules

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Plugin
    from gateway.server.direct import Direct
    from gateway.settings import Settings
    from gateway.telemetry.recorder import Telemetry
    from gateway.upstream.attempts import Upstreams

log = logging.getLogger("sluice")

# Upstream response headers worth passing on; everything else is hop-by-hop or the gateway's to set.
PASSED = frozenset(
    {b"content-type", b"location", b"openai-processing-ms", b"openai-version", b"apim-request-id", b"x-ms-region"}
)
STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))
INTERNAL_CANCELLED = errors.GatewayError("internal gateway error (CancelledError)", code="internal_error")
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
        self.access = logging.getLogger("sluice.access") if settings.log.access else None
        self.inflight = 0
        self.cut = 0  # requests ended by shutdown after the grace period
        # Set by the runtime: may replace `ex.targets` once they are known (Responses: only the backends that
        # have the API; background requests: the gateway's own runner), or reject the request.
        self.route: Callable[[Exchange], None] | None = None
        # Set by the runtime: run after the plugins' on_request (the tenant is known), before any upstream, for
        # the Responses API and stored objects: reads the owner of a stored object and sets its target, or
        # checks a create's references to stored objects against the tenant (gateway/responses/api.py).
        self.admit: Callable[[Exchange], Awaitable[None]] | None = None

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, endpoint: str, path_model: str | None = None
    ) -> None:
        """A request from the ASGI app (or a caller that speaks ASGI: the cache's warm-up, evaluations)."""
        started: float = scope.get(request.ARRIVED) or time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        try:
            body = await request.read_body(receive, headers, self.max_body)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self._reject(send, exc, rid, endpoint, started)
            return
        await self._route(headers, body, started, rid, receive, send, endpoint, path_model, None)

    async def handle_direct(self, direct: Direct, endpoint: str, path_model: str | None = None) -> None:
        """A request on a proxy route from the HTTP/1.1 protocol (server/direct.py), without the ASGI cycle."""
        headers = direct.headers
        rid = direct.request_id
        try:
            body = direct.whole()  # the common case: the body came with the head
            if body is None:
                body = await request.read_body(direct.receive, headers, self.max_body)
            else:
                body = request.taken(body, direct.encoding, self.max_body)
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await self._reject(direct.send, exc, rid, endpoint, direct.arrived)
            return
        await self._route(headers, body, direct.arrived, rid, direct.receive, direct.send, endpoint, path_model, direct)

    async def _route(
        self,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        started: float,
        rid: str,
        receive: Receive,
        send: Send,
        endpoint: str,
        path_model: str | None,
        direct: Direct | None,
    ) -> None:
        """Step 1's end: the Exchange parsed and its targets found, or the request refused."""
        try:
            ex = request.parse(endpoint, headers, body, started, rid, path_model)
        except errors.GatewayError as exc:
            await self._reject(send, exc, rid, endpoint, started)
            return
        ex.mark("parse", started)
        chain = self.chains.get(ex.model)
        if chain is None:
            error = errors.NotFoundError(f"The model `{ex.model}` does not exist", param="model")
            await self._reject(send, error, rid, endpoint, started, ex.model)
            return
        ex.targets = list(chain)
        if self.upstreams.loading:  # empty unless a self-hosted backend is still loading its model
            around_loading(ex, self.upstreams.loading)
        if self.route is not None:
            try:
                self.route(ex)
            except errors.GatewayError as exc:
                await self._reject(send, exc, rid, endpoint, started, ex.model)
                return
        await self.serve(ex, receive, send, direct)

    async def serve(self, ex: Exchange, receive: Receive, send: Send, direct: Direct | None = None) -> None:
        """Steps 2 to 6 for an Exchange whose targets are set (also for requests parsed elsewhere)."""
        if self.telemetry is not None:
            self.telemetry.begin(ex)  # in flight from here; sets the traceparent the upstream gets
        await self._serve(ex, receive, send, direct)

    async def _reject(
        self,
        send: Send,
        error: errors.GatewayError,
        rid: str,
        endpoint: str,
        started: float,
        model: str | None = None,
    ) -> None:
        """A request refused before it was routed (bad JSON, unknown model): answered, counted and logged."""
        if self.telemetry is not None:
            self.telemetry.rejected(error.status)
        await send_error(send, error, rid)
        if self.access is not None:
            refusal_line(self.access, endpoint, error, rid, started, model)

    async def refuse(
        self, send: Send, error: errors.GatewayError, rid: str, endpoint: str, started: float, model: str | None = None
    ) -> None:
        """`_reject` for a front door that parses its own requests (gateway/messages). A method rather than an
        alias: mypyc compiles a class attribute bound to a method into a lookup that fails."""
        await self._reject(send, error, rid, endpoint, started, model)

    async def _serve(self, ex: Exchange, receive: Receive, send: Send, direct: Direct | None) -> None:
        outcome = Outcome.begun()
        task = asyncio.current_task()
        assert task is not None
        done = False

        def client_left(_: object = None) -> None:
            if not done:
                outcome.client_gone = True
                task.cancel()

        # A client that leaves stops the upstream at once, whether we are waiting for the first token or
        # relaying. The protocol's direct path says so when the connection is lost. Under ASGI a disconnect
        # is reported only through receive(): a watcher on it starts once a request has lasted WATCH_AFTER_S
        # (most non-stream answers are done by then; a client gone sooner loses nothing but those
        # milliseconds of upstream work).
        loop = asyncio.get_running_loop()
        watcher: asyncio.Future[Any] | None = None
        timer: asyncio.TimerHandle | None = None
        if direct is not None:
            direct.gone = client_left
            if direct.disconnected:  # gone while the request was parsed
                client_left()
        else:

            def watch() -> None:
                nonlocal watcher
                if not done:
                    watcher = asyncio.ensure_future(receive())
                    watcher.add_done_callback(client_left)

            timer = loop.call_later(WATCH_AFTER_S, watch)
        ended = False  # the response went out, or the client left: neither a shutdown's cut nor a bug
        self.inflight += 1
        try:
            await self._respond(ex, send, outcome, direct)
            ended = True
        except asyncio.CancelledError:
            cancelled = task.cancelling() > 0  # this request's task was cancelled, not something it awaited
            task.uncancel()
            if outcome.client_gone:
                if not outcome.complete:  # a stream whose client left after its end mark is complete
                    outcome.error = outcome.error or "client disconnected"
                ended = True
            elif cancelled:
                # Nothing but the server cancels a request otherwise: shutdown.grace_s is over. The client
                # gets the documented end (an error event and [DONE], or a 503), never a silent cut.
                done = True  # a client leaving now must not cancel the last words
                await self._cut(ex, send, outcome)
            else:
                # A cancellation that came up from below (something awaited was cancelled under the request):
                # a bug, not a shutdown; the client gets an internal error, the log the trace.
                done = True
                log.exception("request %s: cancelled from below, not by a shutdown", ex.request_id)
                await self._end(ex, send, outcome, INTERNAL_CANCELLED)
        finally:
            done = True
            if direct is not None:
                direct.gone = None
            elif timer is not None:
                timer.cancel()
            if watcher is not None:
                watcher.cancel()
            if ex.resource:
                # Reading a stored response generates nothing: its tokens and latency were counted when made.
                outcome.usage = outcome.ttft_ms = outcome.tpot_ms = None
            elif outcome.ttft_ms is None and outcome.complete and (not ex.stream or outcome.source != "upstream"):
                outcome.ttft_ms = outcome.total_ms  # a whole answer, or a plugin's: its first token came with it
            # Plugins hear of every request that reached them, however it ended (a leader that fails
            # must still release the requests following it): in a task of its own after a cut or a bug.
            if not ended:
                self.inflight -= 1
                if self.on_complete:
                    job = loop.create_task(self._complete(ex, outcome))
                    self._background.add(job)
                    job.add_done_callback(self._background.discard)
                elif self.telemetry is not None or self.access is not None:
                    loop.call_soon(self._record, ex, outcome)
        if not ended:
            return  # a cut or a cancellation from below, ended above: its completion is under way already
        # The last byte has gone: the rest runs in this request's own task, which costs nothing the client
        # waits for (uvicorn serves the connection's next request in a task of its own once this response is
        # complete) and saves a task per request, which cost more than most plugins' completion work. The
        # request counts as in flight until it is done, so that a drain waits for it.
        try:
            if self.on_complete:
                await self._complete(ex, outcome)
            elif self.telemetry is not None or self.access is not None:
                self._record(ex, outcome)
        finally:
            self.inflight -= 1

    async def _cut(self, ex: Exchange, send: Send, outcome: Outcome) -> None:
        self.cut += 1
        outcome.error = "gateway shutting down"
        error = errors.ServiceUnavailableError("the gateway is shutting down", code="gateway_shutdown")
        await self._end(ex, send, outcome, error)

    async def _end(self, ex: Exchange, send: Send, outcome: Outcome, error: errors.GatewayError) -> None:
        """End a request that was stopped where it stood: the error as the response, or as the last event."""
        outcome.error = outcome.error or error.message
        try:
            if ex.overhead_ms:  # set just before the head went out: the body is under way
                if ex.stream:  # a whole answer is one message: it went out whole, or cannot be ended cleanly
                    await send({"type": "http.response.body", "body": error.sse_event(), "more_body": False})
            else:
                await send_error(send, error, ex.request_id)
                outcome.status = error.status
        except Exception:
            log.debug("request %s: could not end it before shutdown", ex.request_id, exc_info=True)

    @property
    def busy(self) -> int:
        """Requests in flight, and completion tasks (cache stores, SLO samples) not yet done."""
        return self.inflight + len(self._background)

    async def drain(self, timeout: float = 1.0) -> int:
        """Wait (briefly) for requests ended by shutdown to write their last bytes and for completion tasks;
        return how many requests were cut."""
        deadline = time.monotonic() + timeout
        # Polled once, at shutdown: an Event to set would cost every request on the hot path.
        while self.busy and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return self.cut

    async def _respond(self, ex: Exchange, send: Send, outcome: Outcome, direct: Direct | None) -> None:
        answer = await self._answer(ex, outcome)
        head = self._head(ex, answer, outcome)
        taps: list[Tap] = []
        for _, hook in self.on_response:
            tap = await hook(ex, head)
            if tap is not None:
                taps.append(tap)
        overhead = ex.overhead_ms = (time.perf_counter() - ex.started) * 1000.0 - ex.upstream_ms
        head.headers.append((b"server-timing", server_timing(ex.timings, overhead)))
        head.headers.append((b"x-sluice-overhead-ms", ms_value(overhead)))
        await self._body(send, ex, head, answer, outcome, tuple(taps), direct)
        outcome.total_ms = (time.perf_counter() - ex.started) * 1000.0

    async def _answer(self, ex: Exchange, outcome: Outcome) -> Opened | Reply:
        """Steps 2 and 3: a plugin's reply, an upstream's committed answer, or the error as a reply."""
        try:
            timings = ex.timings
            since = time.perf_counter()
            for name, hook in self.on_request:
                try:
                    reply: Reply | None = await hook(ex)
                except errors.GatewayError:
                    ex.rejected_by = name  # what telemetry says refused it: the plugin, by its name
                    raise
                finally:
                    now = time.perf_counter()  # one clock read a stage: its end is the next one's start
                    timings.append((name, (now - since) * 1000.0))
                    since = now
                if reply is not None:
                    return reply
            if self.admit is not None and (ex.resource or ex.endpoint == "responses"):
                try:
                    await self.admit(ex)
                except errors.GatewayError:
                    ex.rejected_by = "responses"
                    raise
            try:  # step 3, in this frame rather than a coroutine of its own: one awaited frame fewer a request
                return await self.upstreams.open(ex)
            except errors.GatewayError as exc:
                reply = await self._rescue(ex, exc)
                if reply is None:
                    raise
                return reply
            finally:
                if ex.routed is not None:  # a backend with several endpoints chose one: the gateway's time
                    ex.upstream_ms -= ex.route_ms
                    ex.timings.append(("route", ex.route_ms))
                if ex.served is not None:  # the wait for a connection, of the attempt that served
                    ex.timings.append(("pool", ex.pool_ms))
                ex.timings.append(("upstream", ex.upstream_ms - ex.pool_ms))
        except errors.GatewayError as exc:
            outcome.error = exc.detail or exc.message  # the log's: what the client's message leaves out
            return Reply(status=exc.status, headers=[JSON, *exc.headers], body=exc.body(), source="error")
        except Exception as exc:
            # A bug in a plugin or here must still get an answer in the client's format, and a log line.
            log.exception("request %s failed inside the gateway", ex.request_id)
            error = errors.GatewayError(f"internal gateway error ({type(exc).__name__})", code="internal_error")
            outcome.error = error.message
            return Reply(status=500, headers=[JSON], body=error.body(), source="error")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the client left, or the shutdown's grace is over: _serve ends the request
            # Something this request awaited was cancelled under it (not the request): a bug below, answered
            # like any other, never read as a shutdown.
            log.exception("request %s: cancelled from below, not by a shutdown", ex.request_id)
            outcome.error = INTERNAL_CANCELLED.message
            return Reply(status=500, headers=[JSON], body=INTERNAL_CANCELLED.body(), source="error")

    def _head(self, ex: Exchange, answer: Opened | Reply, outcome: Outcome) -> ResponseHead:
        """Step 4: the status and headers the client will get (plugins may still add to them)."""
        if isinstance(answer, Reply):
            status = answer.status
            headers = list(answer.headers)
            outcome.source = answer.source
            streamed = answer.stream is not None
        else:
            status = answer.response.status
            headers = []
            for key, value in answer.response.headers:
                if key in PASSED:
                    headers.append((key, value))
                elif key == b"x-request-id":
                    headers.append((b"x-upstream-request-id", value))
            streamed = ex.stream
        if streamed:
            headers.extend(STREAM_HEADERS)
        headers.append((b"x-request-id", ex.request_id.encode()))
        if ex.served is not None:
            headers.append((b"x-sluice-model", ex.served.model.encode()))
        if ex.fallback is not None:
            headers.append((b"x-sluice-fallback", ex.fallback.encode()))
        outcome.status = status
        return ResponseHead(status, headers)

    async def _body(
        self,
        send: Send,
        ex: Exchange,
        head: ResponseHead,
        answer: Opened | Reply,
        outcome: Outcome,
        taps: tuple[Tap, ...],
        direct: Direct | None,
    ) -> None:
        """Step 5: relay the upstream's stream, or send a whole body or a plugin's stream."""
        if isinstance(answer, Reply):
            if answer.stream is not None:
                await self._send_pieces(send, head, answer.stream, outcome, taps)
            else:
                await self._send_whole(send, head, answer.body, outcome, taps, direct)
            return
        n = ex.json.get("n")
        choices = n if type(n) is int and n > 1 else 1
        if not ex.stream:
            await self._send_whole(send, head, answer.first, outcome, taps, direct)
            if head.status < 400:
                outcome.usage = find_usage(answer.first[-2048:])
                served = ex.served
                if choices > 1 and outcome.usage is not None and served and served.provider.usage_of_first_choice:
                    outcome.usage = all_choices_usage(answer.first, outcome.usage)
                    outcome.usage_source = "estimated"
            return
        try:
            start = {"type": "http.response.start", "status": head.status, "headers": head.headers, BODY_FOLLOWS: True}
            await send(start)
            assert ex.served is not None
            mode = usage_mode(ex.include_usage, ex.served.provider.reports_usage)
            rules = stream_rules(ex.endpoint)
            await relay_stream(
                send, answer.response, answer.first, outcome, taps, ex.started, answer.token_at, mode, rules, choices
            )
        finally:
            answer.response.close()

    async def _rescue(self, ex: Exchange, error: errors.GatewayError) -> Reply | None:
        """Every target failed: a plugin may still answer (a stale cache entry) before the error goes out."""
        for _, hook in self.on_failure:
            reply: Reply | None = await hook(ex, error)
            if reply is not None:
                return reply
        return None

    async def _send_pieces(
        self, send: Send, head: ResponseHead, pieces: AsyncIterator[bytes], outcome: Outcome, taps: tuple[Tap, ...]
    ) -> None:
        await send({"type": "http.response.start", "status": head.status, "headers": head.headers})
        async for piece in pieces:
            for tap in taps:
                tap(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        outcome.complete = True

    async def _send_whole(
        self,
        send: Send,
        head: ResponseHead,
        body: bytes,
        outcome: Outcome,
        taps: tuple[Tap, ...],
        direct: Direct | None,
    ) -> None:
        head.headers.append((b"content-length", str(len(body)).encode()))
        for tap in taps:
            tap(body)
            tap(b"")
        if direct is not None:
            await direct.answer(head.status, head.headers, body)  # the head and body in one write, one call
        else:
            start = {"type": "http.response.start", "status": head.status, "headers": head.headers, BODY_FOLLOWS: True}
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        outcome.complete = True

    def _record(self, ex: Exchange, outcome: Outcome) -> None:
        try:
            if self.telemetry is not None:
                self.telemetry.complete(ex, outcome)
            if self.access is not None:
                access_line(self.access, ex, outcome)
        except Exception:
            log.exception("telemetry failed")

    async def _complete(self, ex: Exchange, outcome: Outcome) -> None:
        self._record(ex, outcome)
        for name, hook in self.on_complete:
            try:
                await hook(ex, outcome)
            except Exception:
                log.exception("plugin %s: on_complete failed", name)


def refusal_line(
    logger: logging.Logger,
    what: str,
    error: errors.GatewayError,
    rid: str,
    started: float,
    model: str | None = None,
) -> None:
    """The access line of a request refused before routing: the same fields, those not known left empty."""
    fields = {
        "request_id": rid,
        "tenant": None,
        "model": model,
        "status": error.status,
        "total_ms": round((time.perf_counter() - started) * 1000.0, 3),
        "rejected_by": "gateway",
        "error": error.code or error.type,
    }
    logger.info("%s %d", what, error.status, extra={"fields": fields})


def access_line(logger: logging.Logger, ex: Exchange, outcome: Outcome) -> None:
    """One line per request, made after it ended: who, what, how it went and where the time went."""
    total = outcome.total_ms if outcome.total_ms > 0 else (time.perf_counter() - ex.started) * 1000.0
    status = outcome.status or 499  # the client left before the head
    fields = {
        "request_id": ex.request_id,
        "tenant": ex.tenant,
        "model": ex.model,
        "served_model": ex.served.model if ex.served is not None else None,
        "stream": ex.stream,
        "status": status,
        "ttft_ms": round(outcome.ttft_ms, 3) if outcome.ttft_ms is not None else None,
        "total_ms": round(total, 3),
        "overhead_ms": round(ex.overhead_ms, 3),
        "fallback": ex.fallback,
        "rejected_by": ex.rejected_by,
        "error": outcome.error,
        **ex.labels,  # what plugins report of the request (the cache's result)
        **ex.attributes,  # and what they add to its span (the entry a semantic hit replayed, its similarity)
    }
    logger.info("%s %d", ex.endpoint, status, extra={"fields": fields})
