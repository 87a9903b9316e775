"""Added TTFT of Anthropic's Messages API against chat completions through one gateway, side by side in one run.

    python3 -m bench.messages_ttft [--requests 400] [--tokens 16]

`sluice serve` (one worker) in front of its simulated backend answering at once (ttft_ms 0, tpot_ms 0). The same
prompt goes alternately to `POST /v1/chat/completions` and `POST /v1/messages` (a translated backend: the
Messages request becomes a chat completion and its stream comes back event by event), streamed, one request at
a time over a keep-alive connection. Per request: the client's time to its first token (text in a chat chunk, a
`text_delta` in a Messages stream) and the gateway's `x-sluice-overhead-ms`. Then the
translation's own CPU per request, in process: the request translated and a 16-token stream translated back.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from gateway.messages.chat_reply import StreamTranslator
from gateway.messages.chat_request import to_chat
from gateway.simulation.answers import Profile, simulate
from tools.bench.fleet import wait_http_ready

CONFIG = """
listen: {host: 127.0.0.1, port: PORT}
backends:
  sim: {type: simulated, ttft_ms: 0, tpot_ms: 0, tokens: TOKENS}
models:
  chat: {backend: sim}
"""
# The first token of each: a chat chunk with text (not the role chunk's empty content), a Messages text delta.
CHAT_TOKEN = re.compile(rb'"content":"[^"]')
MESSAGES_TOKEN = re.compile(rb'"text_delta","text":"[^"]')
PROMPT = "Summarise the role of a sluice gate in a canal in two sentences."


async def first_event(
    client: httpx.AsyncClient, path: str, body: dict[str, object], mark: re.Pattern[bytes]
) -> tuple[float, float]:
    started = time.perf_counter()
    async with client.stream("POST", path, json=body) as response:
        overhead = float(response.headers["x-sluice-overhead-ms"])
        ttft = 0.0
        async for chunk in response.aiter_raw():
            if not ttft and mark.search(chunk):
                ttft = (time.perf_counter() - started) * 1000.0
    if not ttft:
        raise RuntimeError(f"{path}: no first token")
    return ttft, overhead


async def measure(url: str, requests: int) -> dict[str, tuple[list[float], list[float]]]:
    chat = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    messages = {**chat, "max_tokens": 256}
    found: dict[str, tuple[list[float], list[float]]] = {"chat": ([], []), "messages": ([], [])}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for i in range(requests + 50):
            for name, path, body, mark in (
                ("chat", "/v1/chat/completions", chat, CHAT_TOKEN),
                ("messages", "/v1/messages", messages, MESSAGES_TOKEN),
            ):
                ttft, overhead = await first_event(client, path, body, mark)
                if i >= 50:  # the first 50 of each warm the process
                    found[name][0].append(ttft)
                    found[name][1].append(overhead)
    return found


def translation_cpu_us(tokens: int, rounds: int = 2000) -> float:
    body = {"model": "chat", "max_tokens": 256, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    reply = simulate("chat/completions", to_chat(body, "chat"), "chat", Profile(tokens=tokens), usage=True)
    started = time.process_time()
    for _ in range(rounds):
        to_chat(orjson.loads(orjson.dumps(body)), "chat")
        translator = StreamTranslator("chat", 20)
        for piece in reply.pieces:
            translator.feed(piece)
    return (time.process_time() - started) / rounds * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = Path(tmp) / "gateway.yaml"
        config.write_text(CONFIG.replace("PORT", str(port)).replace("TOKENS", str(args.tokens)))
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config)], stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http_ready(url, 60.0, proc=gateway)
            found = asyncio.run(measure(url, args.requests))
        finally:
            gateway.terminate()
            gateway.wait(30)
    p50 = {name: (statistics.median(t), statistics.median(o)) for name, (t, o) in found.items()}
    for name, (ttft, overhead) in p50.items():
        print(f"{name:9} p50 TTFT {ttft:.3f} ms, p50 x-sluice-overhead-ms {overhead:.3f}")
    print(
        f"added by /v1/messages at p50: TTFT {p50['messages'][0] - p50['chat'][0]:+.3f} ms, "
        f"overhead {p50['messages'][1] - p50['chat'][1]:+.3f} ms ({args.requests} requests each, alternating)"
    )
    cpu = translation_cpu_us(args.tokens)
    print(f"translation CPU per request (request + a {args.tokens}-token stream): {cpu:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
