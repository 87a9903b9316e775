"""A Redis subscription off the request path: SUBSCRIBE on one node, each message as it comes, a PING when quiet.

The auth plugin hears of changed keys this way (plugins/auth/authenticator.py). redis-py's asyncio client did
it before, but importing redis-py costs a gateway ~25 MB of resident memory (redis 8 imports its own
observability stack, OpenTelemetry's metrics SDK and psutil among it), a quarter of the memory a gateway with
every stage on may use, for a loop that needs this much of RESP2: AUTH and SELECT as the request-path client
sends them (resp.py), SUBSCRIBE, and the `message` and `pong` pushes of a subscribed connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import hiredis

from gateway.state.resp import Arg, encode, parse_url


class SubscriptionLost(ConnectionError):
    """The server refused a command, closed the connection, or did not answer a PING within the quiet time."""


def _next(parser: hiredis.Reader, host: str, port: int) -> object:
    try:
        return parser.gets()
    except hiredis.ProtocolError as exc:  # not Redis at that address (an HTTP port, a TLS alert), or a broken stream
        raise SubscriptionLost(f"{host}:{port} does not speak RESP: {exc}") from None


async def subscribe(
    url: str,
    channel: str,
    subscribed: Callable[[], None],
    quiet_s: float = 5.0,
    connect_timeout_s: float = 0.5,
) -> AsyncGenerator[bytes, None]:
    """Each message published on `channel` at the node `url` names, until the subscription is lost.

    `subscribed` is called once the server has confirmed the subscription: what was published before then was
    not heard. A connection that is quiet for `quiet_s` is sent a PING; one whose PING gets no answer within
    another `quiet_s` (a stopped or stalled server, a broken link) raises SubscriptionLost, as do a refused
    command and a closed connection; a failed connect raises OSError or TimeoutError."""
    addresses, options, _ = parse_url(url)
    host, port = addresses[0]
    tls = options.tls
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls is not None else None),
        connect_timeout_s,
    )
    try:
        greeting: list[tuple[Arg, ...]] = []
        if options.password is not None:
            user = options.username
            greeting.append(("AUTH", user, options.password) if user else ("AUTH", options.password))
        if options.db:
            greeting.append(("SELECT", options.db))
        greeting.append(("SUBSCRIBE", channel))
        writer.write(b"".join(encode(command) for command in greeting))
        parser = hiredis.Reader()
        unanswered = len(greeting)  # replies to the greeting, the subscription's confirmation last
        pinged = False
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), quiet_s)
            except TimeoutError:
                if pinged:
                    raise SubscriptionLost(f"no answer to PING from {host}:{port} in {quiet_s:g} s") from None
                writer.write(encode(("PING",)))
                pinged = True
                continue
            if not data:
                raise SubscriptionLost(f"{host}:{port} closed the connection")
            pinged = False  # an answer of any kind shows the connection alive
            parser.feed(data)
            while (reply := _next(parser, host, port)) is not False:
                if isinstance(reply, hiredis.ReplyError):
                    raise SubscriptionLost(f"{host}:{port} refused: {reply}")
                if unanswered:
                    unanswered -= 1
                    if not unanswered:
                        subscribed()
                    continue
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                    yield reply[2]  # else a PING's ["pong", ""]
    finally:
        writer.close()
