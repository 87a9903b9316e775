"""Everything toward the backends: the attempt loop, the pools, endpoints, routing policies and providers.

Owns choosing a target's endpoint (round robin, least load, prefix affinity), connecting to it over a warm pool
(HTTP/1.1 on asyncio + httptools, or HTTP/2; a WebSocket to a Responses API: websocket.py), the health of each
endpoint and its warm-up, and one provider module a backend kind in `providers/`, the built-in backend's among
them (`simulation` plays its answers).

Imports: contract, simulation, wire.
"""
