"""The provider's prompt-cache share over a multi-turn Messages session, straight to llama-server and through Sluice.

    python3 -m bench.messages_cache_share [--turns 50]

Two identical `llama-server`s (the pinned build, the tiny random-weight model, one slot each, cold); one session
of `--turns` turns with the `anthropic` SDK against each: straight to the first, through `sluice serve` (a
`llamacpp` backend: the Messages body passed through) to the second. Each turn sends the whole conversation so
far (a system prompt with a `cache_control` mark, the earlier turns, a new user message) with `max_tokens` 8.
The share is the server's own account: the sum of `cache_read_input_tokens` over the sum of the prompt tokens.
Needs the llama-server build (`python3 -m tools.llamacpp build`).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic

from tools.bench.fleet import wait_http_ready
from tools.llamacpp import build as llamacpp
from tools.llamacpp.model import TINY, ensure_model
from tools.llamacpp.server import LlamaServer

SYSTEM = [
    {
        "type": "text",
        "text": "You are a careful assistant for canal engineers. " * 20,
        "cache_control": {"type": "ephemeral"},
    }
]
WORDS = ["sluice", "gate", "lock", "weir", "basin", "channel", "flow", "level", "water", "boat", "canal", "keeper"]


def session(base_url: str, turns: int) -> tuple[int, int]:
    """(prompt tokens, of which read from the server's cache) over a session of `turns` turns."""
    client: Any = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = []
    prompt = cached = 0
    for turn in range(turns):
        question = " ".join(WORDS[(turn + i) % len(WORDS)] for i in range(12))
        messages.append({"role": "user", "content": f"Turn {turn}: {question}?"})
        answer = client.messages.create(model="tiny", max_tokens=8, system=SYSTEM, messages=messages)
        usage = answer.usage
        read = usage.cache_read_input_tokens or 0
        prompt += usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
        cached += read
        messages.append({"role": "assistant", "content": answer.content[0].text or "ok"})
    client.close()
    return prompt, cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=50)
    args = parser.parse_args()
    build = llamacpp.locate()
    model = ensure_model(TINY, build.vocab)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        direct, behind = (
            stack.enter_context(LlamaServer(build.binary, model, Path(tmp), slots=1, context=4096)) for _ in range(2)
        )
        for server in (direct, behind):
            server.start()
        for server in (direct, behind):
            server.wait_ready()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = Path(tmp) / "gateway.yaml"
        config.write_text(
            f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            f'backends:\n  llama: {{type: llamacpp, base_url: "{behind.base_url}"}}\n'
            "models:\n  tiny: {backend: llama}\n"
        )
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config)], stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http_ready(url, 60.0, proc=gateway)
            straight = session(direct.url, args.turns)
            through = session(url, args.turns)
        finally:
            gateway.terminate()
            gateway.wait(30)
    for name, (prompt, cached) in (("direct", straight), ("through Sluice", through)):
        print(f"{name:15} prompt tokens {prompt:6d}, read from cache {cached:6d}: share {cached / prompt:.2%}")
    difference = through[1] / through[0] - straight[1] / straight[0]
    print(f"difference (through - direct): {difference:+.2%} over {args.turns} turns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
