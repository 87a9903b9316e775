"""The client side: the HTTP/1.1 protocol and its limits, request parsing, the relay, the admin and console routes.

Owns what happens between the client's socket and the pipeline: step 1 of every front door (intake.py: read,
parse, targets, refusals), what the pipeline answers through (responder.py), OpenAI's parse with its bounds
(request.py), serving the proxy routes without the ASGI cycle and the one framing of heads and bodies (direct.py,
protocol.py), a connection's addresses looked up when read (address.py), the event loop held instead of asked
for (loop.py), the WebSocket protocol an upgrade switches to (websocket.py), relaying an answer's bytes as they
arrive (relay.py), whole replies (reply.py), the admin routes and the latency console's page (admin.py,
console.py), and the descriptor and garbage-collection policies of a serving process (lifeline.py, collector.py).
It reaches `upstream` for what step 1 needs of it (a backend still loading its model, the descriptor limit).

Imports: contract, telemetry, upstream, wire.
"""
