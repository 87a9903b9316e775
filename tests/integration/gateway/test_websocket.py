"""The Responses API's WebSocket mode end to end: the `openai` SDK's `responses.connect()` and a client on the
`websockets` package speaking the documented protocol, through the gateway to a scripted Responses upstream."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect
from websockets.sync.connection import Connection

from plugins.auth.keys import add, new_key, revoke
from tests.support.gateway import RunningGateway, gateway_process, gateway_thread
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, ResetMidStream, ScriptedUpstream, Status
from tests.support.wait import wait_until

KEY, KEY_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()
WAIT_S = 20.0  # a bound on every wait: generous, a loaded 2-core machine must pass


def config(upstream: str, websocket: str = "") -> str:
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
pool: {{warm_connections: 1}}
models:
  gpt: {{backend: up}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
  rival: {{keys: ["{OTHER_HASH}"]}}
plugins: [auth]
responses: {{websocket: {{{websocket}}}}}
"""


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=2, tokens=5)) as up:
        yield up


@pytest.fixture()
def gateway(upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    with gateway_thread(config(upstream.url)) as gw:
        yield gw


def ws_url(gw: RunningGateway, path: str = "/v1/responses") -> str:
    return f"ws://127.0.0.1:{gw.port}{path}"


def socket(gw: RunningGateway, key: str = KEY, path: str = "/v1/responses", **headers: str) -> ClientConnection:
    sent = {"authorization": f"Bearer {key}", "openai-beta": "responses_websockets=2026-02-06", **headers}
    return connect(ws_url(gw, path), additional_headers=sent, open_timeout=WAIT_S, max_size=None)


def turn(ws: Connection, **body: Any) -> list[dict[str, Any]]:
    """One response.create and every event up to its end: response.completed/failed/incomplete or an error."""
    ws.send(json.dumps({"type": "response.create", **body}))
    return events_until_end(ws)


def events_until_end(ws: Connection) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        event = json.loads(ws.recv(timeout=WAIT_S))
        events.append(event)
        if event["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            return events


def responses_requests(up: ScriptedUpstream) -> list[Any]:
    return [r for r in up.requests if r.path.endswith("/responses")]


def test_the_sdk_runs_turns_that_continue_from_the_connection_s_last_response(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "model": "gpt", "input": "first question", "store": False})
        first = sdk_turn(conn)
        completed = first[-1].response
        conn.send(
            {
                "type": "response.create",
                "model": "gpt",
                "input": [{"role": "user", "content": "second question"}],
                "previous_response_id": completed.id,
                "store": False,
            }
        )
        again = sdk_turn(conn)[-1].response
    kinds = [event.type for event in first]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in first] == list(range(len(first)))
    assert again.id != completed.id
    assert again.status == "completed"
    # The second turn went upstream with the whole conversation and no id to look up (store: false works).
    sent = [r.json for r in responses_requests(upstream)]
    assert len(sent) == 2
    assert "previous_response_id" not in sent[1]
    assert sent[1]["input"][0] == {"type": "message", "role": "user", "content": "first question"}
    assert sent[1]["input"][1]["type"] == "message"
    assert sent[1]["input"][1]["role"] == "assistant"
    assert sent[1]["input"][1]["content"][0]["text"] == completed.output_text
    assert sent[1]["input"][-1] == {"role": "user", "content": "second question"}
    assert all(s["stream"] is True for s in sent)


def sdk_turn(conn: Any) -> list[Any]:
    """The SDK's events of one turn, up to its end."""
    events: list[Any] = []
    for event in conn:
        events.append(event)
        if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
            break
    assert events[-1].type == "response.completed", events[-1]
    return events


def test_turns_run_in_order_and_events_match_the_http_stream(gateway: RunningGateway) -> None:
    with socket(gateway) as ws:
        for text in ("one", "two", "three"):  # sent at once: answered one after the other
            ws.send(json.dumps({"type": "response.create", "model": "gpt", "input": text}))
        turns = [events_until_end(ws) for _ in range(3)]
    over_http = httpx.post(
        f"{gateway.base_url}/responses",
        json={"model": "gpt", "input": "one", "stream": True},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=WAIT_S,
    )
    http_kinds = [line[7:] for line in over_http.text.splitlines() if line.startswith("event: ")]
    assert [event["type"] for event in turns[0]] == http_kinds
    ids = [events[-1]["response"]["id"] for events in turns]
    assert len(set(ids)) == 3
    assert all(events[-1]["type"] == "response.completed" for events in turns)


@pytest.mark.parametrize(
    ("message", "status", "code", "param"),
    [
        ("not json", 400, None, None),
        ('["a list"]', 400, None, None),
        ('{"type": "session.update"}', 400, "unsupported_event_type", "type"),
        ('{"type": "response.create", "input": "no model"}', 400, "missing_model", "model"),
        ('{"type": "response.create", "model": "nope", "input": "x"}', 404, "model_not_found", "model"),
        ('{"type": "response.create", "model": "gpt", "input": 5}', 400, None, "input"),
        ('{"type": "response.create", "model": "gpt", "input": "x", "background": true}', 400, None, "background"),
        ('{"type": "response.create", "model": "gpt", "input": "x", "stream_id": 5}', 400, None, "stream_id"),
    ],
)
def test_a_bad_message_gets_an_error_event_and_the_socket_goes_on(
    gateway: RunningGateway, upstream: ScriptedUpstream, message: str, status: int, code: str | None, param: str | None
) -> None:
    with socket(gateway) as ws:
        ws.send(message)
        error = json.loads(ws.recv(timeout=WAIT_S))
        assert error["type"] == "error"
        assert error["status"] == status
        assert error["error"]["code"] == code
        assert error["error"]["param"] == param
        assert error["error"]["message"]
        ws.send(b"\x00binary")
        assert json.loads(ws.recv(timeout=WAIT_S))["error"]["message"].startswith("send events as JSON text")
        events = turn(ws, model="gpt", input="still here")
        assert events[-1]["type"] == "response.completed"
    assert len(responses_requests(upstream)) == 1


def test_refused_handshakes_are_plain_http_answers(gateway: RunningGateway) -> None:
    cases = [({"authorization": ""}, 401), ({"authorization": "Bearer sk-wrong"}, 401)]
    for headers, status in cases:
        with pytest.raises(InvalidStatus) as caught:
            connect(ws_url(gateway), additional_headers=headers, open_timeout=WAIT_S)
        response = caught.value.response
        assert response.status_code == status
        assert json.loads(response.body)["error"]["type"] == "invalid_request_error"
    with pytest.raises(InvalidStatus) as caught:
        connect(f"ws://127.0.0.1:{gateway.port}/v1/chat/completions", open_timeout=WAIT_S)
    assert caught.value.response.status_code == 404
    # The key may come as `api-key` too, and every Responses path serves the mode.
    for path in ("/v1/responses", "/openai/v1/responses", "/responses"):
        with connect(ws_url(gateway, path), additional_headers={"api-key": KEY}, open_timeout=WAIT_S) as ws:
            assert turn(ws, model="gpt", input="hi")[-1]["type"] == "response.completed"


def test_another_tenant_s_response_cannot_be_continued(gateway: RunningGateway, upstream: ScriptedUpstream) -> None:
    with socket(gateway) as mine:
        made = turn(mine, model="gpt", input="private")[-1]["response"]["id"]
        # The same id from another tenant's socket: unknown to it, whether stored or held by a socket.
        with socket(gateway, OTHER_KEY) as theirs:
            error = turn(theirs, model="gpt", input="x", previous_response_id=made)[-1]
            assert error["type"] == "error"
            assert error["status"] == 404
            assert error["error"]["code"] == "previous_response_not_found"
        # Its owner may continue it, over the socket.
        assert turn(mine, model="gpt", input="more", previous_response_id=made)[-1]["type"] == "response.completed"
    assert len(responses_requests(upstream)) == 2  # the refused turn never reached the backend
    # A stored response of one tenant, named over another tenant's socket: refused the same way.
    stored = openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0).responses.create(
        model="gpt", input="stored"
    )
    with socket(gateway, OTHER_KEY) as theirs:
        error = turn(theirs, model="gpt", input="x", previous_response_id=stored.id)[-1]
        assert error["error"]["code"] == "previous_response_not_found"
    with socket(gateway) as mine:  # and its owner continues it from a new socket: the backend has it
        assert turn(mine, model="gpt", input="y", previous_response_id=stored.id)[-1]["type"] == "response.completed"
    assert responses_requests(upstream)[-1].json["previous_response_id"] == stored.id


def test_pings_are_answered_and_a_message_over_the_limit_closes_with_1009(upstream: ScriptedUpstream) -> None:
    with gateway_thread(config(upstream.url, "max_message_bytes: 2048")) as gw, socket(gw) as ws:
        ws.ping(b"are you there").wait(WAIT_S)
        ws.send(json.dumps({"type": "response.create", "model": "gpt", "input": "x" * 4096}))
        with pytest.raises(ConnectionClosed) as caught:
            ws.recv(timeout=WAIT_S)
        assert caught.value.rcvd is not None
        assert caught.value.rcvd.code == 1009


def test_caps_lifetime_and_idle_timeout(upstream: ScriptedUpstream) -> None:
    with gateway_thread(config(upstream.url, "max_per_tenant: 1, max_lifetime_s: 1.5, idle_timeout_s: 60")) as gw:
        with socket(gw) as first:
            with pytest.raises(InvalidStatus) as caught:
                socket(gw)
            assert caught.value.response.status_code == 429
            assert caught.value.response.headers["retry-after"] == "1"
            assert json.loads(caught.value.response.body)["error"]["code"] == "websocket_connections_exhausted"
            with socket(gw, OTHER_KEY) as other:  # another tenant has its own cap
                assert turn(other, model="gpt", input="x")[-1]["type"] == "response.completed"
            # After its lifetime the socket says why, as OpenAI's does, and closes.
            error = json.loads(first.recv(timeout=WAIT_S))
            assert error["type"] == "error"
            assert error["error"]["code"] == "websocket_connection_limit_reached"
            with pytest.raises(ConnectionClosed) as closed:
                first.recv(timeout=WAIT_S)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1000
        with socket(gw) as again:  # the slot is free once the socket has gone
            assert turn(again, model="gpt", input="x")[-1]["type"] == "response.completed"
    with gateway_thread(config(upstream.url, "idle_timeout_s: 0.5")) as gw, socket(gw) as idle:
        with pytest.raises(ConnectionClosed) as closed:
            idle.recv(timeout=WAIT_S)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1000
        assert closed.value.rcvd.reason == "idle timeout"


def test_shutdown_finishes_the_running_turn_then_closes_with_1001(tmp_path: Path) -> None:
    with (
        ScriptedUpstream(default=Ok(ttft_ms=600, tpot_ms=50, tokens=8)) as up,
        gateway_process(config(up.url), tmp_path) as gw,
        socket(gw) as ws,
    ):
        ws.send(json.dumps({"type": "response.create", "model": "gpt", "input": "slow"}))
        wait_until(lambda: len(responses_requests(up)) == 1, WAIT_S, what="the turn reached the upstream")
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGTERM)
        events = events_until_end(ws)
        assert events[-1]["type"] == "response.completed"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=WAIT_S)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1001
        assert gw.proc.wait(WAIT_S) == 0


def test_a_revoked_key_closes_its_socket_mid_turn(redis_server: RedisServer) -> None:
    key, hashed = new_key()
    hexdigest = hashed.removeprefix("sha256:")
    add(redis_server.url, "beta", hexdigest, None)
    with (
        ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=200, tokens=200)) as up,
        # A short key cache: the revocation is seen within a second or two even if it is published before the
        # gateway's subscription to revocations is up (what is tested here is the sockets' own check).
        gateway_thread(config(up.url) + f'redis: {{url: "{redis_server.url}"}}\nauth: {{cache_ttl_s: 1}}\n') as gw,
        socket(gw, key) as ws,
    ):
        ws.send(json.dumps({"type": "response.create", "model": "gpt", "input": "a long answer"}))
        assert json.loads(ws.recv(timeout=WAIT_S))["type"] == "response.created"
        revoke(redis_server.url, hexdigest)
        events = events_until_end(ws)  # the turn is stopped: no response.completed, an error event
        assert events[-1]["type"] == "error"
        assert events[-1]["status"] == 401
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=WAIT_S)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1008
        assert up.wait_disconnect(WAIT_S)  # and its upstream request was closed


def test_lanes_run_at_once_echo_their_stream_id_and_fork_from_each_other(upstream: ScriptedUpstream) -> None:
    upstream.default = Ok(ttft_ms=300, tpot_ms=2, tokens=5)
    with gateway_thread(config(upstream.url, "max_streams: 2")) as gw, socket(gw) as ws:
        for lane in ("a", "b"):
            ws.send(json.dumps({"type": "response.create", "model": "gpt", "input": f"on {lane}", "stream_id": lane}))
        events: list[dict[str, Any]] = []
        ended: dict[str, dict[str, Any]] = {}
        while len(ended) < 2:
            event = json.loads(ws.recv(timeout=WAIT_S))
            events.append(event)
            if event["type"] == "response.completed":
                ended[event["stream_id"]] = event["response"]
        assert {event["stream_id"] for event in events} == {"a", "b"}  # every event names its lane
        created = [i for i, event in enumerate(events) if event["type"] == "response.created"]
        first_end = next(i for i, event in enumerate(events) if event["type"] == "response.completed")
        assert max(created) < first_end  # both had begun before either ended: they ran at once
        # A third named lane is over the cap; lane b may fork lane a's conversation, from the socket's memory.
        refused = turn(ws, model="gpt", input="fork", previous_response_id=ended["a"]["id"], stream_id="c")
        assert refused[-1]["type"] == "error"
        assert refused[-1]["error"]["code"] == "websocket_stream_limit_reached"
        assert refused[-1]["stream_id"] == "c"
        forked = turn(ws, model="gpt", input="fork", previous_response_id=ended["a"]["id"], stream_id="b")
        assert forked[-1]["type"] == "response.completed"
        assert forked[-1]["stream_id"] == "b"
    sent = responses_requests(upstream)[-1].json
    assert "previous_response_id" not in sent
    assert "stream_id" not in sent
    assert sent["input"][0]["content"] == "on a"
    assert sent["input"][-1]["content"] == "fork"


def test_responses_in_flight_are_capped(upstream: ScriptedUpstream) -> None:
    upstream.default = Ok(ttft_ms=300, tpot_ms=2, tokens=5)
    with gateway_thread(config(upstream.url, "max_in_flight: 2")) as gw, socket(gw) as ws:
        for text in ("one", "two", "three"):
            ws.send(json.dumps({"type": "response.create", "model": "gpt", "input": text}))
        events: list[dict[str, Any]] = []
        while sum(event["type"] == "response.completed" for event in events) < 2:
            events.append(json.loads(ws.recv(timeout=WAIT_S)))
    # The third was refused at once (two were in flight), the first two answered.
    errors = [event for event in events if event["type"] == "error"]
    assert len(errors) == 1
    assert errors[0]["error"]["code"] == "websocket_stream_limit_reached"
    assert len(responses_requests(upstream)) == 2


def test_a_turn_fails_over_before_its_first_event_and_a_rate_limit_is_an_error_event(
    upstream: ScriptedUpstream,
) -> None:
    extra = """
  backup: {backend: up, upstream_model: other}
"""
    text = config(upstream.url).replace("  gpt: {backend: up}\n", "  gpt: {backend: up, fallback: [backup]}" + extra)
    text = text.replace("  acme: {", "  acme: {rate_limit: {requests_per_minute: 2}, ")
    text = text.replace("plugins: [auth]", "plugins: [auth, rate_limit]")
    with gateway_thread(text) as gw, socket(gw) as ws:
        upstream.script(Status(503))
        events = turn(ws, model="gpt", input="first")  # the primary's 503 came before any event: the backup answers
        assert [event["type"] for event in events][:1] == ["response.created"]
        assert events[-1]["type"] == "response.completed"
        assert [r.json["model"] for r in responses_requests(upstream)] == ["gpt", "other"]
        assert turn(ws, model="gpt", input="second")[-1]["type"] == "response.completed"
        limited = turn(ws, model="gpt", input="third")[-1]  # the tenant's 2 a minute are spent: per turn, not socket
        assert limited["type"] == "error"
        assert limited["status"] == 429
        assert limited["error"]["code"] == "rate_limit_exceeded"
        assert int(limited["headers"]["retry-after"]) >= 1


def test_a_stream_cut_mid_turn_is_an_error_event_with_the_status_of_its_cause(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    with socket(gateway) as ws:
        upstream.script(ResetMidStream(after_chunks=2))
        events = turn(ws, model="gpt", input="first")
        assert events[0]["type"] == "response.created"  # under way: too late for another target
        assert events[-1]["type"] == "error"
        assert events[-1]["status"] == 502  # the upstream cut it: a bad gateway, not the gateway's own fault
        assert events[-1]["error"]["type"] == "upstream_error"
        assert turn(ws, model="gpt", input="second")[-1]["type"] == "response.completed"  # the socket goes on
