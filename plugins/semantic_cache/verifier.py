"""The optional verifier: a small chat model asked whether two requests need the same answer.

The question and the reading of its answer are here once, for both of their users: the plugin, which asks a
model of the gateway's own config through the attempt loop and the warm pool (`Verifier`, the way
plugins/semantic_cache/embedder.py embeds), and `sluice cache evaluate --verifier-url`, which asks any
OpenAI-compatible endpoint over HTTP (`verify`).

Only a clear "yes" is agreement: a "no", anything else, an error or the deadline is not, so a verifier can
only turn a hit into a miss, never a miss into a hit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from gateway.context import Exchange
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.upstream.attempts import Upstreams

log = logging.getLogger("sluice.semantic_cache")

PROMPT = (
    "Two requests to an assistant follow. Answer only 'yes' if one answer would serve both exactly, or 'no' if "
    "they differ in anything that changes the answer (numbers, names, dates, units, languages, direction, "
    "negation, scope, quoted text or code).\nRequest A: {a}\nRequest B: {b}\nSame answer?"
)


def question(model: str, a: str, b: str) -> dict[str, Any]:
    """The chat completions request that asks `model` about requests `a` and `b` (two tokens are enough)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
        "max_tokens": 2,
        "temperature": 0,
    }


def agrees(answer: Any) -> bool:
    """Whether a chat completions answer (parsed JSON) is a clear "yes"; anything malformed is not."""
    try:
        text = answer["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        return False
    return isinstance(text, str) and text.strip().lower().startswith("yes")


class Verifier:
    """Asks a model of the gateway's config, through its chain (fallbacks included) and the warm pool."""

    def __init__(self, upstreams: Upstreams, model: str, deadline_s: float) -> None:
        self.upstreams = upstreams
        self.model = model
        self.deadline_s = deadline_s
        self.targets = list(upstreams.chains[model])

    async def same(self, a: str, b: str, origin: Exchange) -> bool:
        """Whether the model says `a` and `b` need the same answer within the deadline (False on anything else)."""
        return await self.verdict(a, b, origin) == "yes"

    async def verdict(self, a: str, b: str, origin: Exchange) -> str:
        """The model's verdict on `a` and `b`: "yes", "no" (or anything but a clear yes), "timeout" or "error".

        Past the deadline the call is cancelled, which closes its upstream request: nothing outlives it.
        """
        body = question(self.model, a, b)
        started = time.perf_counter()
        ex = Exchange(f"{origin.request_id}-verify", "chat/completions", [], orjson.dumps(body), body, started)
        ex.tenant = origin.tenant
        ex.targets = list(self.targets)
        ex.traceparent = origin.traceparent
        try:
            async with asyncio.timeout(self.deadline_s):
                opened = await self.upstreams.open(ex)
        except TimeoutError:
            return "timeout"
        except GatewayError:
            return "error"
        except Exception as exc:  # a transport failure outside the attempt loop's errors: still only a miss
            log.debug("semantic cache: verifier %s failed: %s", self.model, exc)
            return "error"
        try:
            answer = orjson.loads(opened.first)
        except orjson.JSONDecodeError:
            return "error"
        finally:
            opened.response.close()
        return "yes" if agrees(answer) else "no"


async def verify(
    client: httpx.AsyncClient, url: str, model: str, a: str, b: str, deadline_s: float = 0.5, api_key: str = ""
) -> bool:
    """Whether a small chat model says the two requests need the same answer, within its own deadline.

    A timeout, an error or anything but a "yes" is False: the verifier can only turn a hit into a miss.
    """
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/chat/completions"):
        endpoint += "/chat/completions"
    body = question(model, a, b)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(deadline_s):
            response = await client.post(endpoint, json=body, headers=headers)
        if response.status_code != 200:
            return False
        answer = response.json()
    except (TimeoutError, httpx.HTTPError, ValueError):
        return False
    return agrees(answer)
