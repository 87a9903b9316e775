"""A Redis subscription off the request path: SUBSCRIBE on one node, each message handed on as it comes, a PING
when quiet.

The auth plugin hears of changed keys this way (plugins/auth/authenticator.py), and the cache of the keys every
gateway stores (plugins/cache/presence.py), which is a message for every write batch of every gateway: so a
message is handed on from the protocol's `data_received`, with no coroutine, task or timer of its own (an
`asyncio.StreamReader` read under `wait_for` cost about 25k instructions a message). The time of the last
arrival is noted instead, and a waiter wakes when it is a quiet period old. redis-py's asyncio client did this
before, but importing redis-py costs a gateway ~25 MB of resident memory (redis 8 imports its own observability
stack, OpenTelemetry's metrics SDK and psutil among it), for a loop that needs this much of RESP2: AUTH and
SELECT as the request-path client sends them (resp.py), SUBSCRIBE, and the `message` and `pong` pushes of a
subscribed connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NoReturn, cast

import hiredis

from gateway.state.resp import Arg, encode, parse_url


class SubscriptionLost(ConnectionError):
    """The server refused a command, closed the connection, or did not answer a PING within the quiet time."""


class Listener(asyncio.Protocol):
    """The subscribed connection: replies parsed as they arrive; the first failure ends it (`ended`)."""

    def __init__(
        self, where: str, greeting: int, subscribed: Callable[[], None], heard: Callable[[bytes], None]
    ) -> None:
        self.where = where
        self.unanswered = greeting  # replies to the greeting, the subscription's confirmation last
        self.subscribed = subscribed
        self.heard = heard
        self.parser = hiredis.Reader()
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # when something last arrived
        self.closing = False  # closed by us: what follows is no failure

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's subclasses

    def data_received(self, data: bytes) -> None:
        self.last = self.loop.time()
        parser = self.parser
        parser.feed(data)
        try:
            while (reply := parser.gets()) is not False:
                if isinstance(reply, hiredis.ReplyError):
                    raise SubscriptionLost(f"{self.where} refused: {reply}")
                if self.unanswered:
                    self.unanswered -= 1
                    if not self.unanswered:
                        self.subscribed()
                    continue
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                    self.heard(reply[2])  # else a PING's ["pong", ""]
        except hiredis.ProtocolError as exc:  # not Redis there (an HTTP port, a TLS alert), or a broken stream
            self.end(SubscriptionLost(f"{self.where} does not speak RESP: {exc}"))
        except Exception as exc:  # refused, or what a callback raised: the subscription is over either way
            self.end(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.end(SubscriptionLost(f"{self.where} closed the connection"))

    def end(self, exc: Exception) -> None:
        if not self.closing and not self.ended.done():
            self.ended.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


async def subscribe(
    url: str,
    channel: str,
    subscribed: Callable[[], None],
    heard: Callable[[bytes], None],
    quiet_s: float = 5.0,
    connect_timeout_s: float = 0.5,
) -> NoReturn:
    """Hand each message published on `channel` at the node `url` names to `heard`, until the subscription is lost.

    `subscribed` is called once the server has confirmed the subscription: what was published before then was
    not heard. A connection that was quiet for `quiet_s` is sent a PING; one that stays quiet for another
    `quiet_s` (a stopped or stalled server, a broken link) raises SubscriptionLost, as do a refused command and
    a closed connection; a failed connect raises OSError or TimeoutError."""
    addresses, options, _ = parse_url(url)
    host, port = addresses[0]
    tls = options.tls
    greeting: list[tuple[Arg, ...]] = []
    if options.password is not None:
        user = options.username
        greeting.append(("AUTH", user, options.password) if user else ("AUTH", options.password))
    if options.db:
        greeting.append(("SELECT", options.db))
    greeting.append(("SUBSCRIBE", channel))
    loop = asyncio.get_running_loop()
    transport, listener = await asyncio.wait_for(
        loop.create_connection(
            lambda: Listener(f"{host}:{port}", len(greeting), subscribed, heard),
            host,
            port,
            ssl=tls,
            server_hostname=host if tls is not None else None,
        ),
        connect_timeout_s,
    )
    try:
        transport.write(b"".join(encode(command) for command in greeting))
        pinged: float | None = None  # when the PING that is still unanswered went out
        while True:
            if pinged is not None and listener.last > pinged:
                pinged = None  # answered (or anything else arrived: the connection is alive)
            due = (listener.last if pinged is None else pinged) + quiet_s
            now = loop.time()
            if due > now:
                done, _ = await asyncio.wait((listener.ended,), timeout=due - now)
                if done:
                    listener.ended.result()  # raises: the future only ever ends with the failure
                continue
            if pinged is not None:
                raise SubscriptionLost(f"no answer to PING from {host}:{port} in {quiet_s:g} s")
            transport.write(encode(("PING",)))
            pinged = now
    finally:
        listener.closing = True
        transport.close()
