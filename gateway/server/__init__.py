"""The client side: the HTTP/1.1 protocol and its limits, request parsing, the relay, completions in both forms.

Owns what happens between the client's socket and the pipeline: reading and bounding a request, serving the proxy
routes without the ASGI cycle (direct.py), the WebSocket protocol an upgrade switches to (websocket.py), relaying an
answer's bytes as they arrive, and the descriptor and garbage-collection policies of a serving process. It may
import the contract (`gateway.settings`, `gateway.context`, `gateway.plugin`, `gateway.errors`), `state` and
`telemetry`, and `gateway.responses.events` (a stored answer replayed as the Responses API's stream).
"""
