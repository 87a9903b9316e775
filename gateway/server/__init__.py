"""The client side: the HTTP/1.1 protocol and its limits, request parsing, the relay, the admin and console routes.

Owns what happens between the client's socket and the pipeline: reading and bounding a request and parsing it
(request.py), serving the proxy routes without the ASGI cycle (direct.py), the WebSocket protocol an upgrade
switches to (websocket.py), relaying an answer's bytes as they arrive (relay.py), whole replies (reply.py), the
admin routes and the latency console's page (admin.py, console.py), and the descriptor and garbage-collection
policies of a serving process (lifeline.py, collector.py). It may import the contract (`gateway.settings`,
`gateway.context`, `gateway.plugin`, `gateway.errors`), `state`, `telemetry` and `wire` (the APIs' byte forms).
"""
