"""A client socket's own upstream socket (OpenAI's and Azure's WebSocket mode), against a real fake upstream that
speaks the protocol on loopback (tests/support/openai_socket.py): pinned for every turn, continued by id, given
up for HTTP when the upstream refuses or drops it, and never shared between client sockets."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect
from websockets.sync.connection import Connection

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_thread
from tests.support.openai_socket import FakeOpenAI
from tests.support.wait import wait_until

KEY, KEY_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()
WAIT_S = 20.0  # a bound on every wait: generous, a loaded 2-core machine must pass


def config(backend: str) -> str:
    return f"""
backends:
  up: {backend}
pool: {{warm_connections: 1}}
models:
  gpt: {{backend: up, upstream_model: gpt-up}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
  rival: {{keys: ["{OTHER_HASH}"]}}
plugins: [auth]
log: {{access: true}}
"""


class Lines(logging.Handler):
    """The access lines' fields, as the gateway logged them."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(getattr(record, "fields", {}))


@pytest.fixture()
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(ttft_ms=5, tpot_ms=1, tokens=4) as up:
        yield up


@pytest.fixture()
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("sluice.access")
    level = logger.level
    logger.setLevel(logging.INFO)  # the CLI's logging set-up does this; a gateway in a thread has none
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture()
def gateway(fake: FakeOpenAI) -> Iterator[RunningGateway]:
    with gateway_thread(config(f'{{type: openai, base_url: "{fake.url}", api_key: backend-key}}')) as gw:
        yield gw


def socket(gw: RunningGateway, key: str = KEY) -> ClientConnection:
    sent = {"authorization": f"Bearer {key}", "openai-beta": "responses_websockets=2026-02-06"}
    return connect(f"ws://127.0.0.1:{gw.port}/v1/responses", additional_headers=sent, open_timeout=WAIT_S)


def turn(ws: Connection, **body: Any) -> list[dict[str, Any]]:
    ws.send(json.dumps({"type": "response.create", "model": "gpt", **body}))
    events: list[dict[str, Any]] = []
    while True:
        event = json.loads(ws.recv(timeout=WAIT_S))
        events.append(event)
        if event["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            return events


def warm(ws: Connection, fake: FakeOpenAI, count: int = 1) -> str:
    """Codex's first message: `generate: false`, which opens the upstream socket; waits until it is open."""
    ident: str = turn(ws, input=[], generate=False)[-1]["response"]["id"]
    wait_until(lambda: len(fake.sockets) >= count, WAIT_S, what="the upstream socket open")
    return ident


def test_turns_share_one_pinned_socket_and_continue_by_id(
    gateway: RunningGateway, fake: FakeOpenAI, lines: Lines
) -> None:
    with socket(gateway) as ws:
        warm(ws, fake)
        previous = None
        ids = []
        for n in range(4):
            body: dict[str, Any] = {"input": [{"role": "user", "content": f"step {n}"}], "store": False}
            if previous is not None:
                body["previous_response_id"] = previous
            events = turn(ws, **body)
            assert events[-1]["type"] == "response.completed", events[-1]
            assert any(e["type"] == "response.output_text.delta" for e in events)
            previous = events[-1]["response"]["id"]
            ids.append(previous)
    assert len(fake.sockets) == 1  # one upstream socket for every turn
    assert fake.posts == []  # none went over HTTP
    creates = fake.sockets[0].creates
    assert len(creates) == 4
    assert all(create["type"] == "response.create" and "stream" not in create for create in creates)
    assert all(create["model"] == "gpt-up" for create in creates)  # the upstream's name for the model
    assert "previous_response_id" not in creates[0]
    for n in range(1, 4):  # each continues the socket's last response by its id alone, as the client sent it
        assert creates[n]["previous_response_id"] == ids[n - 1]
        assert creates[n]["input"] == [{"role": "user", "content": f"step {n}"}]
    # The gateway's credential on the upgrade, never the client's key.
    headers = fake.sockets[0].headers
    assert headers["authorization"] == "Bearer backend-key"
    assert headers["openai-beta"] == "responses_websockets=2026-02-06"
    assert KEY not in json.dumps(headers)
    # Every turn has its access line, the warm-up included, each naming the socket and the turn.
    wait_until(lambda: len(lines.fields) >= 5, WAIT_S, what="five access lines")
    turns = [f for f in lines.fields if f.get("sluice.transport") == "websocket"]
    assert [f["sluice.turn"] for f in turns] == [1, 2, 3, 4, 5]
    assert turns[0]["sluice.generate"] is False
    assert turns[0]["status"] == 200
    assert turns[0]["tenant"] == "acme"
    assert all(f["status"] == 200 and f.get("sluice.upstream_transport") == "websocket" for f in turns[1:])
    assert all(f["ttft_ms"] is not None and f["ttft_ms"] > 0 for f in turns[1:])  # the relay saw the first token
    assert len({f["sluice.socket"] for f in turns}) == 1


def test_a_response_the_upstream_socket_no_longer_holds_is_sent_whole(
    gateway: RunningGateway, fake: FakeOpenAI
) -> None:
    with socket(gateway) as ws:
        warm(ws, fake)
        first = turn(ws, input="one", store=False)[-1]["response"]["id"]
        fake.evict_next = True
        again = turn(ws, input="two", store=False, previous_response_id=first)
        assert again[-1]["type"] == "response.completed", again[-1]
    creates = fake.sockets[0].creates
    assert len(creates) == 3  # the id alone, refused; then the conversation from the socket's memory
    assert creates[1]["previous_response_id"] == first
    assert "previous_response_id" not in creates[2]
    assert creates[2]["input"][0] == {"type": "message", "role": "user", "content": "one"}
    assert creates[2]["input"][-1] == {"type": "message", "role": "user", "content": "two"}
    assert fake.posts == []


def test_a_refused_upgrade_serves_every_turn_over_http(gateway: RunningGateway, fake: FakeOpenAI) -> None:
    fake.refuse_upgrade = 404
    with socket(gateway) as ws:
        previous = None
        for n in range(3):
            body: dict[str, Any] = {"input": f"step {n}", "store": False}
            if previous is not None:
                body["previous_response_id"] = previous
            events = turn(ws, **body)
            assert events[-1]["type"] == "response.completed", events[-1]
            previous = events[-1]["response"]["id"]
    assert fake.sockets == []
    assert len(fake.posts) == 3
    # Over HTTP the socket's memory expands the conversation (store: false: the upstream holds nothing).
    assert "previous_response_id" not in fake.posts[2].body
    assert fake.posts[2].body["input"][-1] == {"type": "message", "role": "user", "content": "step 2"}
    assert fake.posts[0].headers["authorization"] == "Bearer backend-key"


def test_a_drop_mid_session_keeps_the_client_socket_and_the_next_turns_are_served(
    gateway: RunningGateway, fake: FakeOpenAI
) -> None:
    with socket(gateway) as ws:
        warm(ws, fake)
        first = turn(ws, input="one", store=False)[-1]["response"]["id"]
        fake.drop_next = True
        broken = turn(ws, input="two", store=False, previous_response_id=first)
        assert broken[0]["type"] == "response.created"
        assert broken[-1]["type"] == "error"  # the stream broke after its first event: said, never silent
        # The client's socket is still open: the next turn continues the last good response.
        again = turn(ws, input="three", store=False, previous_response_id=first)
        assert again[-1]["type"] == "response.completed", again[-1]
        # And a later one finds a new upstream socket.
        wait_until(lambda: len(fake.sockets) == 2, WAIT_S, what="a new upstream socket")
        last = again[-1]["response"]["id"]
        final = turn(ws, input="four", store=False, previous_response_id=last)
        assert final[-1]["type"] == "response.completed", final[-1]
    assert len(fake.posts) == 1  # the turn after the drop, over HTTP with the conversation expanded
    assert "previous_response_id" not in fake.posts[0].body
    assert fake.sockets[1].creates[-1]["input"][-1] == {"type": "message", "role": "user", "content": "four"}


def test_azure_gets_its_api_key_and_each_client_socket_its_own_upstream_socket(fake: FakeOpenAI) -> None:
    root = fake.url.removesuffix("/v1")
    backend = f'{{type: azure, base_url: "{root}", api_key: azure-key, api_version: v1}}'
    with gateway_thread(config(backend)) as gw, socket(gw, KEY) as mine, socket(gw, OTHER_KEY) as theirs:
        warm(mine, fake, 1)
        warm(theirs, fake, 2)
        for n in range(2):
            for ws, who in ((mine, "acme"), (theirs, "rival")):
                events = turn(ws, input=f"{who} {n}")
                assert events[-1]["type"] == "response.completed", events[-1]
    assert len(fake.sockets) == 2
    assert fake.posts == []
    for upstream in fake.sockets:
        assert upstream.headers["api-key"] == "azure-key"
        assert "authorization" not in upstream.headers
        assert KEY not in json.dumps(upstream.headers)
        assert OTHER_KEY not in json.dumps(upstream.headers)
        owners = {create["input"].split()[0] for create in upstream.creates}
        assert len(owners) == 1
        assert len(upstream.creates) == 2
    assert {s.creates[0]["input"].split()[0] for s in fake.sockets} == {"acme", "rival"}


def test_websocket_off_keeps_every_turn_on_http(fake: FakeOpenAI) -> None:
    backend = f'{{type: openai, base_url: "{fake.url}", api_key: k, websocket: "off"}}'
    with gateway_thread(config(backend)) as gw, socket(gw) as ws:
        turn(ws, input=[], generate=False)
        for n in range(2):
            assert turn(ws, input=f"x {n}")[-1]["type"] == "response.completed"
    assert fake.sockets == []
    assert len(fake.posts) == 2


def test_a_turn_fails_over_on_an_error_event_and_rate_limits_count_each_create(fake: FakeOpenAI) -> None:
    text = config(f'{{type: openai, base_url: "{fake.url}", api_key: k}}')
    text = text.replace(
        "  gpt: {backend: up, upstream_model: gpt-up}",
        "  gpt: {backend: up, upstream_model: gpt-up, fallback: [backup]}\n"
        "  backup: {backend: up, upstream_model: other}",
    )
    text = text.replace("  acme: {", "  acme: {rate_limit: {requests_per_minute: 3}, ")
    text = text.replace("plugins: [auth]", "plugins: [auth, rate_limit]")
    with gateway_thread(text) as gw, socket(gw) as ws:
        warm(ws, fake)
        fake.fail_next = 503
        events = turn(ws, input="first")  # the primary's 503 came before any event: the backup answers
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] == "response.completed"
        assert turn(ws, input="second")[-1]["type"] == "response.completed"
        assert turn(ws, input="third")[-1]["type"] == "response.completed"
        limited = turn(ws, input="fourth")[-1]  # the tenant's 3 a minute are spent: per create, not per socket
        assert limited["type"] == "error"
        assert limited["status"] == 429
    creates = fake.sockets[0].creates
    assert [c["model"] for c in creates] == ["gpt-up", "other", "gpt-up", "gpt-up"]  # never the fourth
    assert len(fake.sockets) == 1
    assert fake.posts == []


def test_the_upstream_socket_closes_with_the_client_s(gateway: RunningGateway, fake: FakeOpenAI) -> None:
    with socket(gateway) as ws:
        warm(ws, fake)
        assert turn(ws, input="one")[-1]["type"] == "response.completed"
        assert not fake.sockets[0].closed
    wait_until(lambda: fake.sockets[0].closed, WAIT_S, what="the upstream socket closed")
