"""The Responses API and background jobs: stored objects, who owns them, and the streams they replay.

Owns `POST /v1/responses` and its WebSocket mode (`GET /v1/responses` upgraded: sockets.py, socket.py; its upstream
sockets to OpenAI and Azure: pinned.py), the operations on a stored response, the ownership index that keeps each id
to its tenant (index.py), and background jobs, for the Responses API and for chat completions (`x-sluice-background`):
their store, their recorder, their leases (jobs.py, job_store.py, job_recorder.py). The Responses
stream's byte form is `gateway.wire`'s. These decide who may see or change an object, so they fail closed when their
store is unavailable. Operations on stored objects are the pipeline's `dispatch` (stored.py), never the attempt loop.

Imports: contract, server, state, telemetry, upstream, wire.
"""
