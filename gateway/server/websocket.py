"""The WebSocket protocol: uvicorn's wsproto protocol, with the gateway's message limit and a graceful shutdown.

uvicorn switches a connection to this class when an HTTP/1.1 request asks for `Upgrade: websocket` (the
HTTP protocol in protocol.py does so as uvicorn's does), and hands the socket to the ASGI app as a
`websocket` scope (gateway/app.py sends `/v1/responses` to gateway/responses/sockets.py). wsproto (sans-io,
from the python-hyper project, which also keeps h11) does the framing; uvicorn answers pings, pings an idle
peer (`ws_ping_interval`) and closes with 1009 a message over the limit.

Two things differ from uvicorn's class:
- The message limit is the gateway's `responses.websocket.max_message_bytes`, read from the app once per
  connection, so that `sluice serve`, its workers and the tests' servers all apply it.
- At shutdown uvicorn closes every socket at once with 1012. Here the app is told first (a
  `sluice.shutdown` message on its receive channel): the socket's running turn finishes within the grace
  period, then the app closes it with 1001 (going away). A socket the app is not serving is closed as before.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.wsproto_impl import WebsocketBuffer, WSProtocol

SHUTDOWN = "sluice.shutdown"  # the message type the app receives when the server begins to shut down


class SocketProtocol(WSProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = getattr(self.app, "socket_message_limit", None)
        if isinstance(limit, int):
            self.buffer = WebsocketBuffer(limit)

    def shutdown(self) -> None:
        if self.handshake_complete and not self.response_started and not self.close_sent and not self.disconnected:
            self.stop_keepalive()
            self.queue.put_nowait({"type": SHUTDOWN})  # type: ignore[typeddict-item]
            return
        super().shutdown()
