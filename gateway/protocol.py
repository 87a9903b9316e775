"""The HTTP/1.1 server protocol: uvicorn's httptools protocol, with limits on what a client sends before its body.

Like nginx's `large_client_header_buffers`, `client_header_timeout` and `client_body_timeout`:
- the request head (request line and headers) is capped at `limits.max_header_bytes`: over it, 431;
- a head must arrive within `limits.header_timeout_s` of its first byte (or of the connection opening): 408;
- a body may not pause for longer than `limits.body_timeout_s`: 408.
Requests the parser rejects (a bad content-length, a NUL in a header, an unknown method) get a 400. Every one
of these answers is in OpenAI's error format, with `connection: close`.

The common request, whose head and body come in one read, arms no timer: a timer is armed only when a read
ends in the middle of a head or a body, so the cost per request is a few attribute checks.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway import errors
from gateway.settings import LimitSettings

log = logging.getLogger("sluice.http")

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head that is over the limit."""


class GatewayProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits: LimitSettings = getattr(getattr(self.app, "settings", None), "limits", None) or LimitSettings()
        self.max_head = limits.max_header_bytes
        self.header_timeout = limits.header_timeout_s
        self.body_timeout = limits.body_timeout_s
        self.in_head = True  # between requests, or in a head: not in a body
        self.in_body = False  # the head is complete, the body is not
        self.head_bytes = 0  # received in reads that ended inside the current head
        self.big_read = False  # the last read was larger than max_head: measure the head when it completes
        self.last_read = 0.0  # loop.time() of the last read, for the body timeout
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout)  # a connection that never sends a head is not held forever

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self.in_head:
            self.head_bytes += len(data)
            self.big_read = len(data) > self.max_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, HeadTooLarge):
                self._reject(431, f"request head larger than {self.max_head} bytes", "request_header_too_large")
            else:
                self._reject(400, f"invalid HTTP request: {exc}", "invalid_http_request")
            return
        # Only a read that ends inside a head or a body needs a timer; most requests come whole.
        if self.in_head:
            if self.head_bytes > self.max_head:
                self._reject(431, f"request head larger than {self.max_head} bytes", "request_header_too_large")
            elif self.head_bytes and self.timer is None:
                self._arm(self.header_timeout)
        elif self.in_body:
            self.last_read = self.loop.time()
            if self.timer is None:
                self._arm(self.body_timeout)

    def on_headers_complete(self) -> None:
        # Reads that ended inside the head were counted as they came; a head completed within one read
        # larger than the limit is measured here (rare: such a read is over 64 KiB by default).
        if self.big_read and len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > self.max_head:
            raise HeadTooLarge
        self.in_head = False
        self.in_body = True
        self.head_bytes = 0
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.in_head = True
        self.in_body = False
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        self._reject(400, msg, "invalid_http_request")

    def _arm(self, delay: float) -> None:
        self.timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        responding = self.cycle is not None and not self.cycle.response_complete and self.cycle.response_started
        if self.in_body:
            quiet = self.loop.time() - self.last_read
            if quiet < self.body_timeout:
                self._arm(self.body_timeout - quiet)  # the body moved since the timer was armed
            elif responding or (self.cycle is not None and self.cycle.response_complete):
                self.transport.close()  # answered already (a 413 from content-length): just stop waiting
            else:
                self._reject(408, f"request body stalled for {self.body_timeout:g} s", "request_timeout")
        elif responding:
            self._arm(self.header_timeout)  # the previous response is still going out; check again later
        elif self.head_bytes or self.cycle is None:
            self._reject(408, f"request head not received within {self.header_timeout:g} s", "request_timeout")
        else:
            self.transport.close()  # an idle keep-alive connection: uvicorn's own keep-alive timeout covers it

    def _reject(self, status: int, message: str, code: str) -> None:
        log.debug("rejected a request from %s: %s", self.client, message)
        self._disarm()
        body = errors.GatewayError(message, status=status, type="invalid_request_error", code=code).body()
        head = b"HTTP/1.1 %d %s\r\n" % (status, REASONS[status])
        head += b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
        head += b"x-request-id: %032x\r\n\r\n" % random.getrandbits(128)
        self.transport.write(head + body)
        self.transport.close()
