"""Routing across a backend's replicas: real upstreams on loopback, the real gateway, the openai SDK."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import RunningGateway, free_port, gateway_thread
from tests.support.upstream import Ok, ResetBeforeHeaders, ResetMidStream, ScriptedUpstream, Status

HI: list[Any] = [{"role": "user", "content": "hi"}]
SYSTEM = "You are a careful assistant. " * 20  # ~580 characters: two blocks of the shared prompt


@pytest.fixture()
def replicas() -> Iterator[list[ScriptedUpstream]]:
    with ExitStack() as stack:
        yield [stack.enter_context(ScriptedUpstream(default=Ok(ttft_ms=5, tokens=3))) for _ in range(3)]


def config(ups: list[ScriptedUpstream], routing: str, extra: str = "", kind: str = "openai") -> str:
    urls = ", ".join(f'"{up.url}/v1"' for up in ups)
    return f"""
backends:
  fleet: {{type: {kind}, endpoints: [{urls}], routing: {routing} {extra}}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: fleet}}
"""


def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="sk-test", max_retries=0)


def served(ups: list[ScriptedUpstream]) -> list[int]:
    """Model requests each replica has received."""
    return [sum(1 for r in up.requests if r.path.endswith("/chat/completions")) for up in ups]


def which(ups: list[ScriptedUpstream], before: list[int]) -> int:
    """The one replica that received a model request since `before`."""
    after = served(ups)
    (index,) = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
    return index


def poll(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def test_a_conversations_turns_land_on_the_replica_that_has_its_prefix(replicas: list[ScriptedUpstream]) -> None:
    with gateway_thread(config(replicas, "prefix")) as gw:
        sdk = client(gw)
        home: dict[int, int] = {}
        conversations: dict[int, list[dict[str, str]]] = {
            c: [{"role": "system", "content": f"You are assistant number {c}. " + SYSTEM}] for c in range(6)
        }
        for turn in range(3):
            for c, messages in conversations.items():
                messages.append({"role": "user", "content": f"conversation {c} turn {turn}: " + "tell me more " * 30})
                before = served(replicas)
                raw = sdk.chat.completions.with_raw_response.create(model="chat", messages=messages)  # type: ignore[arg-type]
                assert "route;dur=" in raw.headers["server-timing"]
                messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})
                replica = which(replicas, before)
                assert home.setdefault(c, replica) == replica, f"conversation {c} moved at turn {turn}"
        # The first turns shared no prefix and went round in turn: staying put was the policy's choice.
        assert set(home.values()) == {0, 1, 2}


def test_a_hot_prefix_spreads_once_its_replica_is_loaded(replicas: list[ScriptedUpstream]) -> None:
    for up in replicas:
        up.default = Ok(ttft_ms=600, tokens=2)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the same question " * 40}]
    with gateway_thread(config(replicas, "{policy: prefix, max_load_factor: 1.25}")) as gw:
        sdk = client(gw)
        sdk.chat.completions.create(model="chat", messages=messages)  # type: ignore[arg-type]
        first = served(replicas).index(1)
        with ThreadPoolExecutor(9) as pool:
            list(pool.map(lambda _: sdk.chat.completions.create(model="chat", messages=messages), range(9)))  # type: ignore[arg-type]
    counts = served(replicas)
    counts[first] -= 1
    # Nine at once with the same prefix: bounded loads keep each replica within 1.25x the mean (3).
    assert max(counts) <= 4, counts
    assert min(counts) >= 2, counts


def test_a_session_sticks_to_one_replica(replicas: list[ScriptedUpstream]) -> None:
    with gateway_thread(config(replicas, "session")) as gw:
        sdk = client(gw)
        homes: dict[str, set[int]] = {}
        for _ in range(4):
            for s in range(8):
                before = served(replicas)
                if s % 2:
                    sdk.chat.completions.create(model="chat", messages=HI, extra_headers={"x-session-id": f"s{s}"})
                else:
                    sdk.chat.completions.create(model="chat", messages=HI, user=f"s{s}")
                homes.setdefault(f"s{s}", set()).add(which(replicas, before))
    assert all(len(home) == 1 for home in homes.values()), homes
    assert len({next(iter(home)) for home in homes.values()}) >= 2  # sessions are spread, not all on one


def test_least_outstanding_avoids_a_slow_replica(replicas: list[ScriptedUpstream]) -> None:
    slow, fast = replicas[0], replicas[1]
    slow.default = Ok(ttft_ms=1500, tokens=2)
    with gateway_thread(config([slow, fast], "least_outstanding")) as gw:
        sdk = client(gw)
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda _: sdk.chat.completions.create(model="chat", messages=HI),
                    range(40),
                )
            )
    counts = served([slow, fast])
    assert counts[0] + counts[1] == 40
    assert counts[0] <= 8, counts  # the slow one holds its requests; the fast one takes the rest


def test_a_failure_before_the_first_byte_is_served_by_another_endpoint(replicas: list[ScriptedUpstream]) -> None:
    ups = replicas[:2]
    ups[0].script(ResetBeforeHeaders())
    ups[1].script(Status(503))
    spare = replicas[2]
    yaml = f"""
backends:
  fleet: {{type: openai, endpoints: ["{ups[0].url}/v1", "{ups[1].url}/v1"]}}
  spare: {{type: openai, base_url: "{spare.url}/v1"}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: fleet, fallback: [other]}}
  other: {{backend: spare}}
"""
    with gateway_thread(yaml) as gw:
        sdk = client(gw)
        for _ in range(2):
            raw = sdk.chat.completions.with_raw_response.create(model="chat", messages=HI)
            assert raw.headers["x-sluice-model"] == "chat"
            assert "x-sluice-fallback" not in raw.headers
            assert raw.parse().choices[0].message.content
    assert served(ups) == [2, 2]  # each failed once and served once: no endpoint tried twice for a request
    assert served([spare]) == [0]


def test_a_stream_cut_after_its_head_but_before_its_first_chunk_goes_to_another_endpoint(
    replicas: list[ScriptedUpstream],
) -> None:
    ups = replicas[:2]
    ups[0].script(ResetMidStream(after_chunks=0))
    with gateway_thread(config(ups, "round_robin")) as gw:
        for _ in range(2):
            stream = client(gw).chat.completions.create(model="chat", messages=HI, stream=True)
            assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert served(ups)[0] >= 1
    assert sum(served(ups)) == 3


def metric(gw: RunningGateway, line_start: str) -> float | None:
    for line in httpx.get(f"{gw.url}/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_an_endpoint_that_refuses_connections_is_ejected_and_returns(replicas: list[ScriptedUpstream]) -> None:
    good = replicas[0]
    port = free_port()  # nothing listens here yet: connections are refused
    yaml = f"""
backends:
  fleet:
    type: openai
    endpoints: ["{good.url}/v1", "http://127.0.0.1:{port}/v1"]
    outlier: {{consecutive_failures: 2, base_ejection_s: 0.2, max_ejection_s: 0.5}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: fleet}}
"""
    dead = f'sluice_endpoint_up{{backend="fleet",endpoint="127.0.0.1:{port}"}}'
    with gateway_thread(yaml) as gw:
        sdk = client(gw)

        def ask() -> None:
            raw = sdk.chat.completions.with_raw_response.create(model="chat", messages=HI)
            assert raw.status_code == 200

        for _ in range(6):
            ask()  # never an error: a refused connection is retried on the good endpoint
        poll(lambda: metric(gw, dead) == 0.0, what="ejection")
        assert metric(gw, f'sluice_endpoint_up{{backend="fleet",endpoint="127.0.0.1:{good.port}"}}') == 1.0
        with ScriptedUpstream(default=Ok(ttft_ms=5, tokens=3), port=port) as back:

            def probed() -> bool:
                ask()
                return served([back]) != [0]

            poll(probed, what="request to the recovered endpoint")
            poll(lambda: metric(gw, dead) == 1.0, what="return to service")


def test_vllm_metrics_shift_the_choice(replicas: list[ScriptedUpstream]) -> None:
    busy, idle = replicas[0], replicas[1]
    busy.metrics = 'vllm:num_requests_waiting{model_name="m"} 40.0\nvllm:num_requests_running{model_name="m"} 8.0\n'
    idle.metrics = 'vllm:num_requests_waiting{model_name="m"} 0.0\nvllm:num_requests_running{model_name="m"} 0.0\n'
    yaml = config([busy, idle], "{policy: least_outstanding, metrics_interval_s: 0.1}", kind="vllm")
    with gateway_thread(yaml) as gw:
        sdk = client(gw)
        poll(lambda: any(r.path == "/metrics" for r in busy.requests), what="scrape")
        streak = 0

        def idle_streak() -> bool:
            nonlocal streak
            before = served([busy, idle])
            sdk.chat.completions.create(model="chat", messages=HI)
            streak = streak + 1 if which([busy, idle], before) == 1 else 0
            return streak >= 20

        # Two idle endpoints as far as this gateway knows; the busy one's own queue sends everything to the other.
        poll(idle_streak, what="20 requests in a row to the idle replica")


def test_dns_discovery_of_localhost(replicas: list[ScriptedUpstream]) -> None:
    up = replicas[0]
    yaml = f"""
backends:
  fleet: {{type: openai, discovery: {{dns: localhost, port: {up.port}, interval_s: 0.2}}, routing: least_outstanding}}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: fleet}}
"""
    with gateway_thread(yaml) as gw:
        reply = client(gw).chat.completions.create(model="chat", messages=HI)
        assert reply.choices[0].message.content
        assert metric(gw, f'sluice_endpoint_up{{backend="fleet",endpoint="127.0.0.1:{up.port}"}}') == 1.0
    assert served([up]) == [1]
