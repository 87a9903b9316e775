"""Embeddings through the gateway's own upstreams: a model of the config, on any backend with `/v1/embeddings`.

The request goes the way a client's embeddings request would, minus the plugins: an Exchange for the
`embeddings` endpoint whose targets are the embedding model's chain (its fallbacks included), sent by the
attempt loop over the backend's warm pool (`runtime.upstreams.open`). So OpenAI, Azure, vLLM's pooling runner,
TEI, Ollama or llama.cpp serve it with the credentials, TLS, routing and outlier ejection already configured,
and no second HTTP client is made. The tenant and the trace context of the request it serves travel with it.

The answer's first vector is taken as floats or as base64 (either form servers send), and made unit length so
that cosine similarity is a dot product.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from gateway.context import Exchange
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.upstream.attempts import Upstreams
    from plugins.semantic_cache.store import Vector


class EmbedFailed(Exception):
    """The embedding model gave no usable vector (an error status, a transport failure, a malformed answer)."""


class Embedder:
    def __init__(self, upstreams: Upstreams, model: str) -> None:
        self.upstreams = upstreams
        self.model = model
        self.targets = list(upstreams.chains[model])
        self.dimensions: int | None = None  # learnt from the first answer

    async def embed(self, text: str, origin: Exchange) -> Vector:
        body: dict[str, Any] = {"model": self.model, "input": text}
        ex = Exchange(f"{origin.request_id}-embed", "embeddings", [], orjson.dumps(body), body, time.perf_counter())
        ex.tenant = origin.tenant
        ex.targets = list(self.targets)
        ex.traceparent = origin.traceparent
        try:
            opened = await self.upstreams.open(ex)
        except GatewayError as exc:
            raise EmbedFailed(f"{self.model}: {exc.status} {exc.message}") from None
        try:
            answer = opened.first
        finally:
            opened.response.close()
        vector = parse(answer)
        if self.dimensions is None:
            self.dimensions = len(vector)
        elif len(vector) != self.dimensions:
            raise EmbedFailed(f"{self.model}: {len(vector)} dimensions, earlier answers had {self.dimensions}")
        return vector


def parse(answer: bytes) -> Vector:
    """The first embedding of an OpenAI embeddings answer, unit length."""
    try:
        raw = orjson.loads(answer)["data"][0]["embedding"]
        if isinstance(raw, str):
            vector = np.frombuffer(base64.b64decode(raw), dtype="<f4").astype(np.float32)
        else:
            vector = np.asarray(raw, dtype=np.float32)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise EmbedFailed(f"not an embeddings answer ({type(exc).__name__})") from None
    norm = float(np.linalg.norm(vector))
    if vector.ndim != 1 or not len(vector) or not np.isfinite(norm) or norm == 0.0:
        raise EmbedFailed("an empty or zero embedding")
    out: Vector = vector / np.float32(norm)
    return out
