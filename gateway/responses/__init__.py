"""The Responses API: its stored objects, who owns them, and its WebSocket mode.

Owns `POST /v1/responses` and its WebSocket mode (`GET /v1/responses` upgraded: sockets.py, socket.py; its upstream
sockets to OpenAI and Azure: pinned.py), the operations on a stored response or a background job (stored.py), the
ownership index that keeps each id to its tenant (index.py), and which target starts a background job, for the
Responses API and for chat completions (`x-sluice-background`); the jobs themselves are `gateway.jobs`'. The
Responses stream's byte form is `gateway.wire`'s. These decide who may see or change an object, so they fail
closed when their store is unavailable. Operations on stored objects are the pipeline's `dispatch` (stored.py),
never the attempt loop.

Imports: contract, jobs, server, state, telemetry, upstream, wire.
"""
