"""Usage as self-hosted engines really report it, through `sluice serve` and the official SDK.

TGI 2.3 to 3.1 put `usage` on the last content chunk, 3.2 and later on a chunk of its own; llama.cpp counts
one choice in a whole answer's usage and streams one usage chunk per choice. Whatever the shape, the client
gets the stream it asked for, `sluice_tokens_total` counts the tokens and the rate limiter charges them
(a reservation it kept would not leave room for the next request). The stand-ins (`sluice sim --like tgi
|llamacpp`) serve the shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from plugins.auth.keys import new_key
from tests.integration.gateway.test_telemetry import metric, scrape
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.standins import standin

KEY, KEY_HASH = new_key()
MESSAGES: Any = [{"role": "user", "content": "What is a sluice?"}]
TOKENS = 6
SLOTS = 4


@contextmanager
def through(kind: str, **options: Any) -> Iterator[RunningGateway]:
    with standin(kind, tokens=TOKENS, **options) as server:
        yaml = f"""
backends:
  local: {{type: {kind}, base_url: "{server.base_url()}"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: local, upstream_model: sim}}
tenants:
  acme: {{keys: ["{KEY_HASH}"], rate_limit: {{tokens_per_minute: 4000}}}}
plugins: [auth, rate_limit]
"""
        with gateway_thread(yaml) as gw:
            yield gw


def sdk(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)


def remaining(gw: RunningGateway, max_tokens: int) -> int:
    """The tokens left after a request reserving `max_tokens` (and its prompt) is admitted."""
    response = httpx.post(
        f"{gw.base_url}/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "chat", "messages": MESSAGES, "max_tokens": max_tokens},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return int(response.headers["x-ratelimit-remaining-tokens"])


def output_tokens(gw: RunningGateway) -> float:
    return metric(scrape(gw), "sluice_tokens_total", direction="output", tenant="acme", model="chat")


@pytest.mark.parametrize("version", ["3.0.1", "3.2.0"])
@pytest.mark.parametrize("asked", [False, True])
def test_tgi_usage_in_either_shape_is_counted_charged_and_shown_only_when_asked(version: str, asked: bool) -> None:
    with through("tgi", server_version=version) as gw:
        before = remaining(gw, 10)
        gw.settle()
        options: Any = {"include_usage": True} if asked else openai.NOT_GIVEN
        chunks = list(
            sdk(gw).chat.completions.create(
                model="chat", messages=MESSAGES, stream=True, stream_options=options, max_tokens=3000
            )
        )
        gw.settle()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text.split()) == TOKENS
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finish) == 1  # the chunk that carried the usage is kept, whatever happens to its usage
        with_usage = [c for c in chunks if c.usage is not None]
        if not asked:
            assert with_usage == []
            assert all(c.choices for c in chunks)
        else:
            (usage,) = with_usage
            assert usage.usage is not None
            assert usage.usage.completion_tokens == TOKENS
            # As the server sent it: on the finish chunk before 3.2, a chunk of its own from 3.2.
            assert (usage is finish[0]) == (version == "3.0.1")
        assert output_tokens(gw) == TOKENS + TOKENS  # the first request's and the stream's
        # The stream cost its usage, not its reservation of 3,000: there is room for another of those.
        after = remaining(gw, 10)
        assert before - after < 100, (before, after)


def test_llamacpp_n_up_to_its_slots_with_every_choice_counted() -> None:
    with through("llamacpp", max_batch=SLOTS) as gw:
        client = sdk(gw)
        whole = client.chat.completions.create(model="chat", messages=MESSAGES, n=2, max_tokens=100)
        assert [c.index for c in whole.choices] == [0, 1]
        assert whole.usage is not None
        assert whole.usage.completion_tokens == TOKENS  # the server's count: one choice, relayed as it is
        gw.settle()
        assert output_tokens(gw) == 2 * TOKENS  # the accounting counts both

        plain = list(client.chat.completions.create(model="chat", messages=MESSAGES, n=3, stream=True, max_tokens=100))
        gw.settle()
        assert all(c.usage is None and c.choices for c in plain)
        assert sorted({c.choices[0].index for c in plain}) == [0, 1, 2]
        assert output_tokens(gw) == 5 * TOKENS

        asked = list(
            client.chat.completions.create(
                model="chat",
                messages=MESSAGES,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=100,
            )
        )
        gw.settle()
        usages = [c.usage for c in asked if c.usage is not None]
        assert [u.completion_tokens for u in usages] == [TOKENS, TOKENS]  # one per choice, passed through
        assert all(u.prompt_tokens_details is not None for u in usages)
        assert output_tokens(gw) == 7 * TOKENS

        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="chat", messages=MESSAGES, n=SLOTS + 1, max_tokens=100)
        assert f"1 <= value <= {SLOTS}" in refused.value.message
        assert refused.value.param == "n"  # named from the server's message, which has no `param`
        # Every one of them cost its usage: 7 x 6 tokens and the prompts, not n x the default reservation.
        left = remaining(gw, 10)
        assert left > 4000 - 7 * TOKENS - 200, left
