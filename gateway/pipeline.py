"""The request path: the only module with request control flow. Six steps, one direction.

    1 parse     done before this module, by the front door's intake (server/intake.py): the request read and
                parsed into an Exchange with its targets, or refused; `serve` is the one entry after it, with
                the responder its answer goes through (server/responder.py)
    2 request   plugins' on_request in config order; a Reply answers now, a GatewayError rejects; then, for
                a Responses create, the admission step (`admit`): its references to stored objects checked
                against its tenant
    3 upstream  an operation on a stored object goes to `dispatch` (its owner's, only for its owner); anything
                else to upstreams.open(): targets tried in order until one gives its first chunk; if none does,
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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway import errors
from gateway.plugin import Outcome, Reply, ResponseHead, Tap, hooks
from gateway.server.loop import running_loop
from gateway.server.relay import all_choices_usage, find_usage, relay_stream, usage_mode
from gateway.server.reply import BODY_FOLLOWS, JSON, end_early, send_pieces, send_whole
from gateway.telemetry.access import access_line
from gateway.telemetry.durations import ms_value, server_timing
from gateway.upstream.attempts import Opened
from gateway.wire.marks import stream_rules

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Hooks, OnComplete, OnFailure, OnRequest, OnResponse, Plugin
    from gateway.server.responder import Responder
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
Admit = Callable[["Exchange"], Awaitable[None]]
Dispatch = Callable[["Exchange"], Awaitable[Opened]]


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        upstreams: Upstreams,
        plugins: list[Plugin],
        telemetry: Telemetry | None = None,
        admit: Admit | None = None,
        dispatch: Dispatch | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.telemetry = telemetry
        self.on_request: Hooks[OnRequest] = hooks(plugins, "on_request")
        self.on_failure: Hooks[OnFailure] = hooks(plugins, "on_failure")
        self.on_response: Hooks[OnResponse] = hooks(plugins, "on_response")
        self.on_complete: Hooks[OnComplete] = hooks(plugins, "on_complete")
        self._background: set[asyncio.Task[None]] = set()
        self.access = logging.getLogger("sluice.access") if settings.log.access else None
        self.inflight = 0
        self.cut = 0  # requests ended by shutdown after the grace period
        # Run after the plugins' on_request (the tenant is known), before any upstream, for a Responses create:
        # checks its references to stored objects against the tenant (gateway/responses/api.py).
        self.admit = admit
        # Serves an operation on a stored object (`ex.resource`), after auth and admission, instead of the
        # attempt loop: its owner's, and only for its owner (gateway/responses/stored.py).
        self.dispatch = dispatch

    async def serve(self, ex: Exchange, responder: Responder) -> None:
        """Steps 2 to 6 for an Exchange whose targets are set: the one entry, for every front door."""
        if self.telemetry is not None:
            self.telemetry.begin(ex)  # in flight from here; sets the traceparent the upstream gets
        outcome = Outcome(0)
        task = asyncio.current_task(running_loop())  # the loop held: asking costs a system call (server/loop.py)
        assert task is not None
        done = False

        def client_left() -> None:
            if not done:
                outcome.client_gone = True
                task.cancel()

        # A client that leaves stops the upstream at once, whether we are waiting for the first token or
        # relaying (server/responder.py says how each transport learns of it).
        responder.watch(client_left)
        ended = False  # the response went out, or the client left: neither a shutdown's cut nor a bug
        self.inflight += 1
        try:
            answer = await self._answer(ex, outcome)  # awaited here, not below a frame of its own: see test_frames
            head, taps = await self._head(ex, answer, outcome)
            await self._body(responder, ex, head, answer, outcome, taps)
            outcome.total_ms = (time.perf_counter() - ex.started) * 1000.0
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
                await self._cut(ex, responder, outcome)
            else:
                # A cancellation that came up from below (something awaited was cancelled under the request):
                # a bug, not a shutdown; the client gets an internal error, the log the trace.
                done = True
                log.exception("request %s: cancelled from below, not by a shutdown", ex.request_id)
                await end_early(ex, responder, outcome, INTERNAL_CANCELLED)
        finally:
            done = True
            responder.unwatch()
            self._settle(ex, outcome)
            if not ended:
                self._complete_later(ex, outcome)
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

    @staticmethod
    def _settle(ex: Exchange, outcome: Outcome) -> None:
        if ex.resource:
            # Reading a stored response generates nothing: its tokens and latency were counted when made.
            outcome.usage = outcome.ttft_ms = outcome.tpot_ms = None
        elif outcome.ttft_ms is None and outcome.complete and (not ex.stream or outcome.source != "upstream"):
            outcome.ttft_ms = outcome.total_ms  # a whole answer, or a plugin's: its first token came with it

    def _complete_later(self, ex: Exchange, outcome: Outcome) -> None:
        """Plugins hear of every request that reached them, however it ended (a leader that fails must still
        release the requests following it): in a task of its own after a cut or a bug."""
        self.inflight -= 1
        loop = asyncio.get_running_loop()
        if self.on_complete:
            job = loop.create_task(self._complete(ex, outcome))
            self._background.add(job)
            job.add_done_callback(self._background.discard)
        elif self.telemetry is not None or self.access is not None:
            loop.call_soon(self._record, ex, outcome)

    async def _cut(self, ex: Exchange, responder: Responder, outcome: Outcome) -> None:
        self.cut += 1
        outcome.error = "gateway shutting down"
        error = errors.ServiceUnavailableError("the gateway is shutting down", code="gateway_shutdown")
        await end_early(ex, responder, outcome, error)

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

    async def _answer(self, ex: Exchange, outcome: Outcome) -> Opened | Reply:
        """Steps 2 and 3: a plugin's reply, an upstream's committed answer, or the error as a reply."""
        try:
            timings = ex.timings
            since = time.perf_counter()
            for name, hook in self.on_request:
                try:
                    # A coroutine, or a plain method's answer (one that never waits in its common case): no
                    # coroutine made and awaited for it.
                    answered = hook(ex)
                    reply = answered if answered is None or isinstance(answered, Reply) else await answered
                except errors.GatewayError:
                    ex.rejected_by = name  # what telemetry says refused it: the plugin, by its name
                    raise
                finally:
                    now = time.perf_counter()  # one clock read a stage: its end is the next one's start
                    timings.append((name, (now - since) * 1000.0))
                    since = now
                if reply is not None:
                    return reply
            if ex.endpoint == "responses" and self.admit is not None and not ex.resource:
                try:
                    await self.admit(ex)
                except errors.GatewayError:
                    ex.rejected_by = "responses"
                    raise
            try:  # step 3, in this frame rather than a coroutine of its own: one awaited frame fewer a request
                if ex.resource and self.dispatch is not None:
                    return await self.dispatch(ex)  # a stored object: read, cancelled or deleted, never tried
                return await self.upstreams.open(ex)
            except errors.GatewayError as exc:
                reply = await self._rescue(ex, exc) if not ex.resource else None
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
        except Exception as bug:  # named apart from `exc`: compiled, a name bound by two clauses has one type
            # A bug in a plugin or here must still get an answer in the client's format, and a log line.
            log.exception("request %s failed inside the gateway", ex.request_id)
            error = errors.GatewayError(f"internal gateway error ({type(bug).__name__})", code="internal_error")
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

    async def _head(
        self, ex: Exchange, answer: Opened | Reply, outcome: Outcome
    ) -> tuple[ResponseHead, tuple[Tap, ...]]:
        """Step 4: the status and headers the client will get, with what the plugins' on_response add, and their
        taps; the overhead so far in the Server-Timing."""
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
        if ex.response_headers is not None:
            headers += ex.response_headers
        outcome.status = status
        head = ResponseHead(status, headers)
        taps: list[Tap] = []
        for _, hook in self.on_response:
            tap = await hook(ex, head)
            if tap is not None:
                taps.append(tap)
        overhead = ex.overhead_ms = (time.perf_counter() - ex.started) * 1000.0 - ex.upstream_ms
        timing = ex.server_timing = server_timing(ex.timings, overhead)  # the console keeps it (telemetry/console.py)
        headers.append((b"server-timing", timing))
        headers.append((b"x-sluice-overhead-ms", ms_value(overhead)))
        return head, tuple(taps)

    async def _body(
        self,
        responder: Responder,
        ex: Exchange,
        head: ResponseHead,
        answer: Opened | Reply,
        outcome: Outcome,
        taps: tuple[Tap, ...],
    ) -> None:
        """Step 5: relay the upstream's stream, or send a whole body or a plugin's stream."""
        if isinstance(answer, Reply):
            if answer.stream is not None:
                await send_pieces(responder.send, head, answer.stream, outcome, taps)
            else:
                await send_whole(responder, head, answer.body, outcome, taps)
            outcome.usage = answer.usage
            return
        n = ex.json.get("n")
        choices = n if type(n) is int and n > 1 else 1
        if not ex.stream:
            await send_whole(responder, head, answer.first, outcome, taps)
            if head.status < 400:
                outcome.usage = find_usage(answer.first[-2048:])
                served = ex.served
                if choices > 1 and outcome.usage is not None and served and served.provider.usage_of_first_choice:
                    outcome.usage = all_choices_usage(answer.first, outcome.usage)
                    outcome.usage_source = "estimated"
            return
        try:
            start = {"type": "http.response.start", "status": head.status, "headers": head.headers, BODY_FOLLOWS: True}
            send = responder.send
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
                pending = hook(ex, outcome)
                if pending is not None:  # a coroutine; a plain method's work is done (gateway/plugin.py)
                    await pending
            except Exception:
                log.exception("plugin %s: on_complete failed", name)
