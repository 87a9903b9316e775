"""The latency console: /console and its JSON, on the admin routes with their access rules, fed by real requests.

A request sent with the `openai` SDK appears among the recent requests, and its waterfall has the stages its
response's `server-timing` named, with the same durations; filters, percentiles and state answer; the ring keeps
only the last N.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import RunningGateway, free_port, gateway_process, gateway_thread, wait_ready
from tests.support.wait import wait_until

BASE = """
backends: {sim: {type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 4}}
models:
  chat: {backend: sim}
  other: {backend: sim}
"""


def timing_of(header: str) -> list[tuple[str, str]]:
    """`parse;dur=0.021, upstream;dur=1.2` -> [("parse", "0.021"), ("upstream", "1.200")]."""
    stages = []
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        stages.append((name, dur))
    return stages


def send(gw: RunningGateway, model: str = "chat", stream: bool = False) -> tuple[str, str]:
    """(x-request-id, server-timing) of one chat completion sent with the openai SDK."""
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, stream=stream)
    if stream:
        for _ in raw.parse():
            pass
    client.close()
    return raw.headers["x-request-id"], raw.headers["server-timing"]


def recorded(url: str, rid: str, headers: dict[str, str] | None = None) -> dict[str, object]:
    """The request's waterfall once its completion task has recorded it (after the client had its answer)."""
    found: dict[str, object] = {}

    def there() -> bool:
        response = httpx.get(f"{url}/console/api/requests/{rid}", headers=headers)
        if response.status_code == 200:
            found.update(response.json())
        return bool(found)

    wait_until(there, 10.0, interval=0.01, what=f"request {rid} in the console")
    return found


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_shows_with_its_waterfall_as_its_server_timing_said(stream: bool) -> None:
    with gateway_thread(BASE) as gw:
        rid, timing = send(gw, stream=stream)
        waterfall = recorded(gw.url, rid)
        stages = waterfall["stages"]
        assert isinstance(stages, list)
        said = timing_of(timing)
        assert [(s["name"], s["dur"]) for s in stages] + [("overhead", waterfall["overhead_dur"])] == said
        assert waterfall["server_timing"] == timing
        assert {s["name"]: s["kind"] for s in stages}["upstream"] == "upstream"
        assert {s["name"]: s["kind"] for s in stages}["parse"] == "gateway"
        starts = [s["start_ms"] for s in stages]
        assert starts == sorted(starts)  # laid end to end in the order they ran
        marks = waterfall["marks"]
        assert isinstance(marks, dict)
        assert 0 < marks["head_ms"] <= marks["first_token_ms"] <= marks["last_byte_ms"]
        assert waterfall["stream"] is stream
        listed = httpx.get(gw.url + "/console/api/requests").json()
        assert listed["requests"][0]["id"] == rid
        assert listed["capacity"] == 10_000


def test_filters_percentiles_and_state() -> None:
    with gateway_thread(BASE) as gw:
        chat_id, _ = send(gw, "chat")
        other_id, _ = send(gw, "other", stream=True)
        recorded(gw.url, chat_id)
        recorded(gw.url, other_id)
        unknown = httpx.post(gw.base_url + "/chat/completions", json={"model": "chat", "messages": "not a list"})
        assert unknown.status_code == 400

        def ids(**query: str) -> list[str]:
            rows = httpx.get(gw.url + "/console/api/requests", params=query).json()["requests"]
            return [row["id"] for row in rows]

        assert ids(model="chat") == [chat_id]
        assert ids(model="other") == [other_id]
        assert ids(status="2xx") == [other_id, chat_id]
        assert ids(status="5xx") == []
        assert ids(door="chat/completions") == [other_id, chat_id]
        assert ids(door="embeddings") == []
        assert ids(tenant="nobody") == []
        assert ids(slow_ms="100000") == []
        assert ids(id=chat_id[:8]) == [chat_id]
        assert ids(limit="1") == [other_id]
        missing = httpx.get(gw.url + "/console/api/requests/no-such-request")
        assert missing.status_code == 404

        table = httpx.get(gw.url + "/console/api/percentiles", params={"minutes": "5"}).json()
        rows = {row["model"]: row for row in table["table"]}
        assert set(rows) == {"chat", "other"}
        assert rows["chat"]["requests"] == 1
        assert rows["chat"]["ttft"]["p50"] > 0
        assert rows["other"]["tpot"]["p50"] is not None  # a stream has a time per output token
        assert set(table["chart"]) == {"chat", "other"}
        assert httpx.get(gw.url + "/console/api/percentiles", params={"minutes": "nan"}).status_code == 200

        state = httpx.get(gw.url + "/console/api/state").json()
        assert state["backends"]["sim"]["state"] == "up"
        page = httpx.get(gw.url + "/console")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "<script" in page.text
        offline = page.text.replace("http://www.w3.org/2000/svg", "")  # a namespace name, never fetched
        assert "http://" not in offline
        assert "https://" not in offline  # no CDN: everything is inline


def test_the_ring_keeps_the_last_n() -> None:
    with gateway_thread(BASE + "admin: {console: {requests: 3}}\n") as gw:
        sent = [send(gw)[0] for _ in range(5)]
        recorded(gw.url, sent[-1])
        listed = httpx.get(gw.url + "/console/api/requests").json()
        assert listed["capacity"] == 3
        assert [row["id"] for row in listed["requests"]] == sent[:1:-1]
        assert httpx.get(f"{gw.url}/console/api/requests/{sent[0]}").status_code == 404


def test_the_console_follows_the_admin_routes_access_rules() -> None:
    token = {"authorization": "Bearer s3cret-admin"}
    with gateway_thread(BASE + "listen: {host: 0.0.0.0}\nadmin: {token: s3cret-admin}\n") as gw:
        rid, _ = send(gw)
        for path in ("/console/api/requests", f"/console/api/requests/{rid}", "/console/api/state"):
            refused = httpx.get(gw.url + path)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_admin_token"
        assert recorded(gw.url, rid, token)["id"] == rid
        assert httpx.get(gw.url + "/console").status_code == 200  # the page alone: it holds no data, asks the token
    with gateway_thread(BASE + "listen: {host: 0.0.0.0}\n") as gw:  # not loopback, neither port nor token
        assert httpx.get(gw.url + "/console").status_code == 404
        assert httpx.get(gw.url + "/console/api/requests").status_code == 404
    port = free_port()
    with gateway_thread(BASE + f"admin: {{port: {port}}}\n") as gw:
        rid, _ = send(gw)
        assert httpx.get(gw.url + "/console").status_code == 404  # no longer on the tenants' port
        assert recorded(f"http://127.0.0.1:{port}", rid)["id"] == rid
    with gateway_thread(BASE + "admin: {console: {enabled: false}}\n") as gw:
        send(gw)
        assert httpx.get(gw.url + "/console").status_code == 404
        assert gw.app is not None
        assert gw.app.runtime is not None
        assert gw.app.runtime.telemetry.ring is None


def test_with_workers_every_poll_shows_every_workers_requests(tmp_path: Path) -> None:
    """`--workers 2`: requests on new connections spread over both workers; every poll, whichever worker the kernel
    gives it to, lists them all and finds each one's waterfall."""
    port = free_port()
    with gateway_process(BASE + f"admin: {{port: {port}}}\n", tmp_path, "--workers", "2") as gw:
        admin = f"http://127.0.0.1:{port}"
        wait_ready(admin)
        sent = []
        for _ in range(8):
            with httpx.Client() as client:  # a new connection each: the kernel picks a worker for each
                body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
                response = client.post(gw.base_url + "/chat/completions", json=body)
                assert response.status_code == 200
                sent.append(response.headers["x-request-id"])

        def listed() -> set[str]:
            with httpx.Client() as client:  # a new connection: any worker may answer
                rows = client.get(admin + "/console/api/requests").json()
            assert rows["from"] == "every worker"
            return {row["id"] for row in rows["requests"]}

        wait_until(lambda: listed() == set(sent), 10.0, interval=0.05, what="every request listed")
        for rid in sent:
            for _ in range(3):
                with httpx.Client() as client:
                    found = client.get(f"{admin}/console/api/requests/{rid}")
                assert found.status_code == 200, found.text
                assert found.json()["id"] == rid
            assert listed() == set(sent)
        with httpx.Client() as client:
            table = client.get(admin + "/console/api/percentiles").json()["table"]
        assert [row["requests"] for row in table] == [8]
