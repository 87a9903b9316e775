"""The WebSocket protocol: uvicorn's wsproto protocol, with the gateway's message limit and a graceful shutdown.

uvicorn switches a connection to this class when an HTTP/1.1 request asks for `Upgrade: websocket` (the
HTTP protocol in protocol.py does so as uvicorn's does), and hands the socket to the ASGI app as a
`websocket` scope (gateway/app.py sends `/v1/responses` to gateway/responses/sockets.py). wsproto (sans-io,
from the python-hyper project, which also keeps h11) does the framing; uvicorn answers pings, pings an idle
peer (`ws_ping_interval`) and closes with 1009 a message over the limit.

Three things differ from uvicorn's class:
- The message limit is the gateway's `responses.websocket.max_message_bytes`, read from the app once per
  connection, so that `sluice serve`, its workers and the tests' servers all apply it.
- At shutdown uvicorn closes every socket at once with 1012. Here the app is told first (a
  `sluice.shutdown` message on its receive channel): the socket's running turn finishes within the grace
  period, then the app closes it with 1001 (going away). A socket the app is not serving is closed as before.
- The app may send several text messages in one ASGI message (`sluice.websocket.send_many`, announced in the
  scope's extensions): their frames go out in one write. A turn's events arrive from the upstream several to
  a read (the first five of a Responses stream come together), and a write per event cost a system call each.
"""

from __future__ import annotations

from typing import Any

import wsproto.events
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.wsproto_impl import WebsocketBuffer, WSProtocol
from wsproto.utilities import LocalProtocolError

SHUTDOWN = "sluice.shutdown"  # the message type the app receives when the server begins to shut down
# An ASGI extension (named in the scope) and its message: several text messages framed and written at once.
SEND_MANY = "sluice.websocket.send_many"


class SocketProtocol(WSProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = getattr(self.app, "socket_message_limit", None)
        if isinstance(limit, int):
            self.buffer = WebsocketBuffer(limit)

    def handle_connect(self, event: wsproto.events.Request) -> None:
        super().handle_connect(event)
        self.scope["extensions"][SEND_MANY] = {}

    async def send(self, message: Any) -> None:
        if message["type"] != SEND_MANY:
            await super().send(message)
            return
        if not self.writable.is_set():
            await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()
        if not self.handshake_complete or self.close_sent or self.response_started:
            raise RuntimeError(f"'{SEND_MANY}' is only for an open socket")
        try:
            output = b"".join(self.conn.send(wsproto.events.Message(data=text)) for text in message["texts"])
        except LocalProtocolError as exc:
            raise ClientDisconnected from exc
        if not self.transport.is_closing():
            self.transport.write(output)

    def shutdown(self) -> None:
        if self.handshake_complete and not self.response_started and not self.close_sent and not self.disconnected:
            self.stop_keepalive()
            self.queue.put_nowait({"type": SHUTDOWN})  # type: ignore[typeddict-item]
            return
        super().shutdown()
