"""The standalone simulated upstream on a loopback port, driven by the openai SDK, httpx and raw sockets."""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
import httpx
import orjson
import pytest
from openai import AsyncAzureOpenAI, AsyncOpenAI, BadRequestError, NotFoundError

from gateway.simulation.answers import Profile
from tools.sim.server import start_server

FAST = Profile(ttft_ms=5.0, tpot_ms=1.0, tokens=6, embedding_dim=8)
MESSAGES: Any = [{"role": "user", "content": "hello"}]

Serve = Callable[[Profile], Awaitable[int]]


@pytest.fixture()
async def serve() -> AsyncIterator[Serve]:
    """Start simulated upstreams on free ports; they are closed after the test."""
    servers: list[asyncio.Server] = []

    async def start(profile: Profile) -> int:
        server = await start_server("127.0.0.1", 0, profile)
        servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture()
async def port(serve: Serve) -> int:
    return await serve(FAST)


def client(port: int) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


# Raw HTTP/1.1, to see framing, pipelining and connection handling as they are on the wire.


@dataclass
class Message:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    complete: bool = False

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class Collector:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.messages.append(Message())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.messages[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.messages[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.messages[-1].chunks.append(body)

    def on_message_complete(self) -> None:
        self.messages[-1].complete = True


def request(method: str, path: str, body: Any = None, headers: str = "") -> bytes:
    payload = b"" if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    head = f"{method} {path} HTTP/1.1\r\nhost: sim\r\ncontent-length: {len(payload)}\r\n{headers}\r\n"
    return head.encode() + payload


async def exchange(port: int, data: bytes, count: int) -> tuple[list[Message], bool]:
    """Send raw bytes on one connection; return the first `count` responses and whether the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    collector = Collector()
    closed = False
    try:
        writer.write(data)
        while sum(m.complete for m in collector.messages) < count:
            chunk = await asyncio.wait_for(reader.read(65536), 5.0)
            if not chunk:
                closed = True
                break
            collector.parser.feed_data(chunk)
        if not closed:
            try:
                closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
            except TimeoutError:
                closed = False
    finally:
        writer.close()
        await writer.wait_closed()
    return collector.messages, closed


# The openai SDK against the OpenAI shape


async def test_chat_completion(port: int) -> None:
    async with client(port) as sdk:
        answer = await sdk.chat.completions.create(model="gpt-x", messages=MESSAGES)
    assert answer.model == "gpt-x"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 6


async def test_chat_stream_with_usage(port: int) -> None:
    async with client(port) as sdk:
        stream = await sdk.chat.completions.create(
            model="gpt-x", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, max_tokens=4
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:5]] == [c.choices[0].delta.content for c in chunks[1:5] if c]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


async def test_stream_and_non_stream_text_match(port: int) -> None:
    async with client(port) as sdk:
        answer = await sdk.chat.completions.create(model="gpt-x", messages=MESSAGES)
        stream = await sdk.chat.completions.create(model="gpt-x", messages=MESSAGES, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == answer.choices[0].message.content


async def test_completions(port: int) -> None:
    async with client(port) as sdk:
        answer = await sdk.completions.create(model="legacy", prompt="once upon a time", max_tokens=3)
        stream = await sdk.completions.create(model="legacy", prompt="once upon a time", max_tokens=3, stream=True)
        chunks = [chunk async for chunk in stream]
    assert answer.object == "text_completion"
    assert answer.model == "legacy"
    assert len(answer.choices[0].text.split(" ")) == 3
    assert answer.choices[0].finish_reason == "length"
    assert "".join(chunk.choices[0].text for chunk in chunks) == answer.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_embeddings(port: int) -> None:
    async with client(port) as sdk:
        default = await sdk.embeddings.create(model="embed", input=["one", "two words"])  # base64 on the wire
        floats = await sdk.embeddings.create(model="embed", input=["one", "two words"], encoding_format="float")
    assert default.model == "embed"
    assert [len(item.embedding) for item in default.data] == [8, 8]
    assert default.usage.prompt_tokens == 3
    for packed, plain in zip(default.data, floats.data, strict=True):
        assert packed.embedding == pytest.approx(plain.embedding, rel=1e-6)


async def test_errors_reach_the_sdk_as_openai_errors(port: int) -> None:
    async with client(port) as sdk:
        with pytest.raises(BadRequestError) as bad:
            await sdk.chat.completions.create(model="gpt-x", messages=[])
        with pytest.raises(NotFoundError):
            await sdk.post("/audio/speech", cast_to=httpx.Response, body={})
    assert bad.value.param == "messages"


async def test_models_list(port: int) -> None:
    async with client(port) as sdk:
        models = await sdk.models.list()
    assert [model.id for model in models.data] == ["sim"]


# The Azure shape


async def test_azure_deployment_is_the_model(port: int) -> None:
    async with AsyncAzureOpenAI(
        azure_endpoint=f"http://127.0.0.1:{port}", api_version="2024-10-21", api_key="x", max_retries=0
    ) as azure:
        answer = await azure.chat.completions.create(model="my-deployment", messages=MESSAGES)
        stream = await azure.chat.completions.create(model="my-deployment", messages=MESSAGES, stream=True)
        chunks = [chunk async for chunk in stream]
        embedded = await azure.embeddings.create(model="embed-deployment", input="text")
        legacy = await azure.completions.create(model="text-deployment", prompt="hi")
    assert answer.model == "my-deployment"
    assert answer.choices[0].message.content
    assert {chunk.model for chunk in chunks} == {"my-deployment"}
    assert embedded.model == "embed-deployment"
    assert legacy.model == "text-deployment"


async def test_openai_v1_prefix(port: int) -> None:
    sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/openai/v1", api_key="x", max_retries=0)
    async with sdk:
        answer = await sdk.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.model == "m"


# Timing


async def test_stream_timing_follows_the_profile(serve: Serve) -> None:
    # Tokens 50 ms apart, and bounds with room: a loaded machine may deliver two chunks in one read, or late.
    port = await serve(Profile(ttft_ms=100.0, tpot_ms=50.0, tokens=6))
    async with client(port) as sdk:
        started = time.perf_counter()
        stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        arrivals = [time.perf_counter() - started async for chunk in stream if chunk.choices[0].delta.content]
    assert len(arrivals) == 6
    assert 0.09 <= arrivals[0] < 2.0
    assert arrivals[-1] - arrivals[0] >= 5 * 0.050 * 0.6  # spread out over the stream, not sent at once
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert sum(gap >= 0.02 for gap in gaps) >= 2, gaps  # paced: not one burst at the end


async def test_non_stream_waits_for_the_whole_generation(serve: Serve) -> None:
    port = await serve(Profile(ttft_ms=50.0, tpot_ms=10.0, tokens=6))
    async with client(port) as sdk:
        started = time.perf_counter()
        await sdk.chat.completions.create(model="m", messages=MESSAGES)
        elapsed = time.perf_counter() - started
    assert 0.095 <= elapsed < 3.0  # at least the generation's 100 ms; the bound only catches a hang


async def test_header_overrides(serve: Serve) -> None:
    port = await serve(Profile(ttft_ms=2000.0, tpot_ms=100.0, tokens=16))
    fast = {"x-sim-ttft-ms": "0", "x-sim-tpot-ms": "0", "x-sim-tokens": "3"}
    async with client(port) as sdk:
        started = time.perf_counter()
        answer = await sdk.chat.completions.create(model="m", messages=MESSAGES, extra_headers=fast)
        elapsed = time.perf_counter() - started
        with pytest.raises(BadRequestError):
            await sdk.chat.completions.create(model="m", messages=MESSAGES, extra_headers={"x-sim-tokens": "many"})
    assert elapsed < 2.0  # the profile's own first token alone would take 2 s
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3


# HTTP/1.1 behaviour


async def test_keep_alive_serves_many_requests_on_one_connection(port: int) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    local_ports = set()
    counts = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as http:
        for i in range(50):
            stream = i % 2 == 1
            response = await http.post(
                "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": stream}
            )
            assert response.status_code == 200
            assert response.headers["content-type"] == ("text/event-stream" if stream else "application/json")
            local_ports.add(response.extensions["network_stream"].get_extra_info("client_addr")[1])
            counts.append(int(response.headers["x-sim-requests"]))
    assert len(local_ports) == 1
    assert counts == list(range(1, 51))


async def test_stream_framing_is_one_http_chunk_per_event(port: int) -> None:
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    [message], _ = await exchange(port, request("POST", "/v1/chat/completions", body), 1)
    assert message.headers["transfer-encoding"] == "chunked"
    assert message.headers["content-type"] == "text/event-stream"
    assert message.headers["cache-control"] == "no-cache"
    assert "content-length" not in message.headers
    assert len(message.chunks) == 1 + 6 + 1 + 1
    assert all(chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") for chunk in message.chunks)
    assert message.chunks[-1] == b"data: [DONE]\n\n"


async def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    data = b"".join(
        (
            request("POST", "/v1/chat/completions", {"model": "first", "messages": MESSAGES, "stream": True}),
            request("GET", "/health"),
            request("POST", "/v1/chat/completions", {"model": "third", "messages": MESSAGES}),
            request("GET", "/v1/models"),
        )
    )
    messages, closed = await exchange(port, data, 4)
    assert [m.status for m in messages] == [200, 200, 200, 200]
    assert b'"model":"first"' in messages[0].body
    assert orjson.loads(messages[1].body) == {"status": "ok"}
    assert orjson.loads(messages[2].body)["model"] == "third"
    assert orjson.loads(messages[3].body)["data"][0]["id"] == "sim"
    assert not closed


async def test_connection_close_is_honoured(port: int) -> None:
    body = {"model": "m", "messages": MESSAGES}
    data = request("POST", "/v1/chat/completions", body, "connection: close\r\n") + request("GET", "/health")
    messages, closed = await exchange(port, data, 2)
    assert closed
    assert len(messages) == 1
    assert messages[0].status == 200
    assert messages[0].headers["connection"] == "close"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (request("POST", "/v1/unknown", {"model": "m"}), 404),
        (request("GET", "/v2/chat/completions"), 404),
        (request("POST", "/v1/chat/completions", b"{not json"), 400),
        (request("POST", "/v1/chat/completions", b"[1, 2]"), 400),
        (request("POST", "/v1/chat/completions", {"messages": MESSAGES}), 400),  # no model
        (request("GET", "/v1/chat/completions"), 405),
        (request("GET", "/healthz"), 200),
    ],
)
async def test_status_codes(port: int, data: bytes, status: int) -> None:
    [message], closed = await exchange(port, data, 1)
    assert message.status == status
    assert message.headers["content-type"] == "application/json"
    assert int(message.headers["content-length"]) == len(message.body)
    if status != 200:
        assert set(orjson.loads(message.body)["error"]) == {"message", "type", "param", "code"}
    assert not closed


async def test_request_counter_counts_model_calls(port: int) -> None:
    data = b"".join(
        (
            request("POST", "/v1/embeddings", {"model": "e", "input": "a"}),
            request("GET", "/health"),
            request("POST", "/openai/deployments/d/completions?api-version=2024-10-21", {"prompt": "a"}),
        )
    )
    messages, _ = await exchange(port, data, 3)
    assert [m.headers["x-sim-requests"] for m in messages] == ["1", "1", "2"]


async def test_client_leaving_mid_stream_stops_the_stream(serve: Serve) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        port = await serve(Profile(ttft_ms=0.0, tpot_ms=30.0, tokens=10))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("POST", "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True}))
        assert b"data: " in await asyncio.wait_for(reader.read(65536), 2.0)
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.4)  # not a wait for a condition: past the end of the stream, had it kept going
        [message], _ = await exchange(port, request("GET", "/health"), 1)
        assert message.status == 200
    finally:
        loop.set_exception_handler(None)
    assert errors == []


async def test_malformed_request_gets_a_400_after_earlier_answers_then_close(port: int) -> None:
    data = request("GET", "/health") + b"NOT HTTP AT ALL\r\n\r\n"
    messages, closed = await exchange(port, data, 2)
    assert [m.status for m in messages] == [200, 400]
    assert closed


async def test_main_serves_on_uvloop_and_says_where() -> None:
    code = (
        "from gateway.simulation.answers import Profile; from tools.sim.server import main; "
        "main('127.0.0.1', 0, Profile())"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 10.0)).decode()
        found = re.fullmatch(
            r"sluice sim listening on http://127\.0\.0\.1:(\d+)/v1 \(ttft 150 ms, tpot 15 ms, 16 tokens\)\n", line
        )
        assert found is not None, line
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        [message], _ = await exchange(int(found.group(1)), request("POST", "/v1/chat/completions", body), 1)
        assert message.status == 200
        assert message.chunks[-1] == b"data: [DONE]\n\n"
    finally:
        process.terminate()
        await process.communicate()
