"""Stored objects and tenants: another tenant's ids are refused whatever state Redis is in, nothing is forwarded
without an owner, auth comes before any lookup, a DELETE holds on every instance, and reads are rate-limited.

Two `sluice serve` processes share one real redis-server; the Responses backend is a stand-in upstream that
records every request it gets, so "refused before anything goes upstream" is checked on what it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.responses.index import index_key
from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_process, gateway_thread
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, Recorded, ScriptedUpstream
from tests.support.wait import wait_until

KEY, KEY_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()
SLOW_SIM = "{type: simulated, ttft_ms: 20, tpot_ms: 100, tokens: 400}"  # a job that runs for ~40 s
FAST_SIM = "{type: simulated, ttft_ms: 5, tpot_ms: 1, tokens: 5}"
UNAVAILABLE = {"response_store_unavailable", "background_unavailable"}


def config(upstream: str, redis_url: str | None, sim: str = SLOW_SIM, extra: str = "") -> str:
    redis = f'redis: {{url: "{redis_url}"}}' if redis_url else ""
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
  sim: {sim}
pool: {{warm_connections: 1}}
models:
  gpt: {{backend: up}}
  m: {{backend: sim}}
tenants:
  acme: {{keys: ["{KEY_HASH}"]}}
  rival: {{keys: ["{OTHER_HASH}"]}}
plugins: [auth]
{redis}
{extra}
"""


@pytest.fixture()
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=5, tpot_ms=1, tokens=4)) as up:
        yield up


def call(gw: RunningGateway, method: str, path: str, key: str | None = KEY, **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    headers.update(kwargs.pop("headers", {}))
    return httpx.request(method, f"{gw.base_url}{path}", headers=headers, timeout=10, **kwargs)


def create(gw: RunningGateway, key: str = KEY, **body: Any) -> dict[str, Any]:
    made = call(gw, "POST", "/responses", key, json={"model": "gpt", "input": secrets.token_hex(8), **body})
    assert made.status_code == 200, made.text
    answer: dict[str, Any] = made.json()
    return answer


def sent_upstream(up: ScriptedUpstream, since: int) -> list[Recorded]:
    return up.requests[since:]


class Made:
    """What the owner (acme) made through the first instance: a stored response, a Responses job, a chat job."""

    def __init__(self, gw: RunningGateway, redis: RedisServer) -> None:
        self.response = create(gw)
        self.item = self.response["output"][0]["id"]
        job = call(gw, "POST", "/responses", json={"model": "m", "input": "a long story", "background": True})
        assert job.status_code == 200, job.text
        self.job = job.json()["id"]
        body = {"model": "m", "messages": [{"role": "user", "content": "long"}]}
        chat = call(gw, "POST", "/chat/completions", json=body, headers={"x-sluice-background": "true"})
        assert chat.status_code == 202, chat.text
        self.chat = chat.json()["id"]
        with redis.client() as client:  # written in the background: wait until every owner record is in Redis
            wait_until(lambda: all(client.exists(index_key(i)) for i in self.ids()), what="owner records written")

    def ids(self) -> tuple[str, str, str]:
        return self.response["id"], self.job, self.chat

    def reads(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Every operation on the three objects: (method, path, httpx arguments)."""
        rid = self.response["id"]
        return [
            ("GET", f"/responses/{rid}", {}),
            ("GET", f"/responses/{rid}/input_items", {}),
            ("POST", f"/responses/{rid}/cancel", {}),
            ("GET", f"/responses/{self.job}", {}),
            ("GET", f"/responses/{self.job}?stream=true", {}),
            ("POST", f"/responses/{self.job}/cancel", {}),
            ("GET", f"/sluice/background/{self.chat}", {}),
            ("GET", f"/sluice/background/{self.chat}/events", {}),
        ]

    def references(self) -> list[dict[str, Any]]:
        """Creates that continue or quote the owner's response."""
        rid = self.response["id"]
        return [
            {"model": "gpt", "input": secrets.token_hex(8), "previous_response_id": rid},
            {"model": "m", "input": secrets.token_hex(8), "previous_response_id": rid, "background": True},
            {"model": "gpt", "input": [{"type": "item_reference", "id": self.item}]},
            {"model": "gpt", "input": [{"id": self.item}]},  # `type` is optional on an item reference
        ]


def refused(answer: httpx.Response, statuses: set[int]) -> None:
    assert answer.status_code in statuses, (answer.status_code, answer.text)
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if answer.status_code == 503:
        assert answer.headers["retry-after"] == "1"
        assert error["code"] in UNAVAILABLE


@pytest.mark.parametrize("state", ["up", "stalled", "stopped", "restarted_empty"])
def test_another_tenant_is_refused_whatever_state_redis_is_in(
    state: str, redis_server: RedisServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    text = config(upstream.url, redis_server.url)
    with gateway_process(text, tmp_path) as one, gateway_process(text, tmp_path) as two:
        made = Made(one, redis_server)
        assert call(two, "GET", f"/responses/{made.response['id']}").status_code == 200  # the owner reads it anywhere
        before = len(upstream.requests)
        # While Redis cannot answer, nobody can be told who owns an id: 503, for the owner as for the rival.
        # Once it has forgotten everything, every id is unknown: 404, answered here.
        expected = {"up": {404}, "stalled": {503}, "stopped": {503}, "restarted_empty": {404}}[state]
        if state == "stalled":
            redis_server.pause()
        elif state in ("stopped", "restarted_empty"):
            redis_server.stop()
            if state == "restarted_empty":
                redis_server.start()
                # Back, and empty: once each instance has noticed (its breaker's second), unknown ids are 404s.
                probe = f"/responses/resp_{secrets.token_hex(24)}"
                wait_until(
                    lambda: all(call(gw, "GET", probe).status_code == 404 for gw in (one, two)),
                    timeout=15,
                    what="both instances reading the restarted Redis",
                )
        try:
            for gw in (one, two):
                for method, path, kwargs in made.reads():
                    refused(call(gw, method, path, OTHER_KEY, **kwargs), expected)
                refused(call(gw, "DELETE", f"/responses/{made.response['id']}", OTHER_KEY), expected)
                refused(call(gw, "DELETE", f"/responses/{made.job}", OTHER_KEY), expected)
                for body in made.references():
                    refused(call(gw, "POST", "/responses", OTHER_KEY, json=body), expected)
                if state != "up":  # the owner is refused the same way: no owner can be read, or there is none
                    for method, path, kwargs in made.reads():
                        refused(call(gw, method, path, **kwargs), expected)
                    refused(call(gw, "POST", "/responses", json=made.references()[0]), expected)
            assert sent_upstream(upstream, before) == []  # none of it was forwarded, to any backend
        finally:
            if state == "stalled":
                redis_server.resume()
        if state in ("up", "stalled"):
            # Everything is still there for its owner, on both instances, once Redis answers again.
            def readable() -> bool:
                return all(
                    call(gw, "GET", f"/responses/{i}").status_code == 200 for gw in (one, two) for i in made.ids()[:2]
                )

            wait_until(readable, timeout=15, what="the owner reads its objects again")
            chat = call(two, "GET", f"/sluice/background/{made.chat}")
            assert chat.status_code == 200  # (how a job itself fares through a stall is test_background.py's)
            assert chat.json()["id"] == made.chat
            follow = call(two, "POST", "/responses", json=made.references()[0])
            assert follow.status_code == 200  # the owner may continue its own response
            assert upstream.requests[-1].json["previous_response_id"] == made.response["id"]


def test_a_reference_to_another_tenants_object_is_refused_before_anything_goes_upstream(
    upstream: ScriptedUpstream,
) -> None:
    with gateway_thread(config(upstream.url, None, FAST_SIM)) as gw:
        mine = create(gw)
        item = mine["output"][0]["id"]
        before = len(upstream.requests)
        previous = call(
            gw, "POST", "/responses", OTHER_KEY, json={"model": "gpt", "input": "x", "previous_response_id": mine["id"]}
        )
        assert previous.status_code == 404
        assert previous.json() == {
            "error": {
                "message": f"Previous response with id '{mine['id']}' not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            }
        }
        unknown = call(
            gw,
            "POST",
            "/responses",
            OTHER_KEY,
            json={"model": "gpt", "input": "x", "previous_response_id": "resp_" + secrets.token_hex(24)},
        )
        assert unknown.status_code == 404  # the same answer for an id that exists and one that does not
        assert unknown.json()["error"]["message"].startswith("Previous response with id")
        quoted = call(
            gw,
            "POST",
            "/responses",
            OTHER_KEY,
            json={"model": "gpt", "input": [{"type": "item_reference", "id": item}]},
        )
        assert quoted.status_code == 404
        assert quoted.json()["error"]["param"] == "input"
        conversation = call(gw, "POST", "/responses", json={"model": "gpt", "input": "x", "conversation": "conv_1"})
        assert conversation.status_code == 404  # no conversation has an owner here: not even the caller's own
        assert conversation.json()["error"]["param"] == "conversation"
        background = call(
            gw,
            "POST",
            "/responses",
            OTHER_KEY,
            json={"model": "m", "input": "x", "background": True, "previous_response_id": mine["id"]},
        )
        assert background.status_code == 404  # a job the gateway would run is checked the same way
        assert sent_upstream(upstream, before) == []
        # The owner may use both, and they reach the backend as sent.
        follow = create(gw, previous_response_id=mine["id"])
        assert upstream.requests[-1].json["previous_response_id"] == mine["id"]
        create(gw, input=[{"type": "item_reference", "id": item}, {"role": "user", "content": "and?"}])
        assert upstream.requests[-1].json["input"][0] == {"type": "item_reference", "id": item}
        create(gw, input=[{"type": "item_reference", "id": follow["output"][0]["id"]}])  # an item from a stream too
        streamed = call(gw, "POST", "/responses", json={"model": "gpt", "input": "s", "stream": True})
        streamed_item = stream_item(streamed.text)
        create(gw, input=[{"type": "item_reference", "id": streamed_item}])
        assert len(sent_upstream(upstream, before)) == 5


def stream_item(text: str) -> str:
    """The id of the first output item a Responses stream announced."""
    for line in text.splitlines():
        if line.startswith("data: ") and "response.output_item.added" in line:
            item_id: str = json.loads(line[6:])["item"]["id"]
            return item_id
    raise AssertionError("no output_item.added event")


def test_without_a_key_every_id_gets_the_same_401_before_any_lookup(
    redis_server: RedisServer, upstream: ScriptedUpstream
) -> None:
    with gateway_thread(config(upstream.url, redis_server.url, FAST_SIM)) as gw:
        made = Made(gw, redis_server)
        before = len(upstream.requests)
        paths = [
            ("GET", f"/responses/{made.response['id']}"),
            ("GET", f"/responses/resp_{secrets.token_hex(24)}"),
            ("DELETE", f"/responses/{made.response['id']}"),
            ("POST", f"/responses/{made.job}/cancel"),
            ("POST", f"/responses/resp_{secrets.token_hex(24)}/cancel"),
            ("GET", f"/sluice/background/{made.chat}"),
            ("GET", f"/sluice/background/bgjob_{secrets.token_hex(24)}"),
            ("GET", f"/sluice/background/{made.chat}/events"),
        ]

        def answers(key: str | None) -> set[tuple[int, bytes]]:
            return {(a.status_code, a.content) for a in (call(gw, m, p, key) for m, p in paths)}

        (missing,) = answers(None)  # one answer, whatever the id
        assert missing[0] == 401
        (wrong,) = answers("sk-not-a-key")
        assert wrong[0] == 401
        redis_server.stop()  # no lookup is even tried: still a 401, not the 503 of an owner that cannot be read
        assert answers(None) == {missing}
        assert sent_upstream(upstream, before) == []


def test_a_delete_through_one_instance_holds_on_every_instance(
    redis_server: RedisServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    text = config(upstream.url, redis_server.url, FAST_SIM)
    with gateway_process(text, tmp_path) as one, gateway_process(text, tmp_path) as two:
        stored = create(one)
        rid = stored["id"]
        job = call(one, "POST", "/responses", json={"model": "m", "input": "short", "background": True}).json()["id"]
        wait_until(lambda: call(one, "GET", f"/responses/{job}").json()["status"] == "completed", what="job done")
        for path in (
            f"/responses/{rid}",
            f"/responses/{rid}/input_items",
            f"/responses/{job}",
            f"/responses/{job}/input_items",
        ):
            assert call(one, "GET", path).status_code == 200  # read on the instance that made them
        assert call(one, "GET", f"/responses/{job}?stream=true").text.count("event: ") > 5
        for ident in (rid, job):
            deleted = call(two, "DELETE", f"/responses/{ident}")
            assert deleted.status_code == 200
            assert deleted.json()["deleted"] is True
        before = len(upstream.requests)
        for gw in (one, two):
            for path in (
                f"/responses/{rid}",
                f"/responses/{rid}/input_items",
                f"/responses/{job}",
                f"/responses/{job}?stream=true",
                f"/responses/{job}/input_items",
            ):
                refused(call(gw, "GET", path), {404})
        assert sent_upstream(upstream, before) == []  # answered by the instances, without asking the backend
        with redis_server.client() as client:
            assert client.keys(f"*{job}*") == []  # its record, input items, events and owner: all gone
            assert client.keys(f"*{rid}*") == []


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "redis"])
def test_reads_of_random_ids_are_rate_limited_and_never_reach_the_upstream(
    shared: bool, upstream: ScriptedUpstream
) -> None:
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(RedisServer()).url if shared else None
        _read_random_ids(upstream, redis_url)


def _read_random_ids(upstream: ScriptedUpstream, redis_url: str | None) -> None:
    limit = "rate_limit: {requests_per_minute: 600}"
    text = config(upstream.url, redis_url, FAST_SIM).replace("plugins: [auth]", "plugins: [auth, rate_limit]")
    text = text.replace(f'["{KEY_HASH}"]}}', f'["{KEY_HASH}"], {limit}}}').replace(
        f'["{OTHER_HASH}"]}}', f'["{OTHER_HASH}"], {limit}}}'
    )
    assert text.count("requests_per_minute") == 2
    with gateway_thread(text) as gw:

        async def read_all() -> list[int]:
            headers = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=10) as client:
                gate = asyncio.Semaphore(16)

                async def one(i: int) -> int:
                    async with gate:
                        ident = "resp_" + secrets.token_hex(24)
                        path = f"/responses/{ident}/cancel" if i % 4 == 0 else f"/responses/{ident}"
                        answer = await (client.post(path) if i % 4 == 0 else client.get(path))
                        return answer.status_code

                return await asyncio.gather(*(one(i) for i in range(1000)))

        started = time.monotonic()
        statuses = asyncio.run(read_all())
        took = time.monotonic() - started
        assert set(statuses) == {404, 429}
        # 600 a minute: the bucket's 600, and what it refilled (10 a second) while the reads ran.
        assert 600 <= statuses.count(404) <= 600 + 10 * took + 5, (statuses.count(404), took)
        assert upstream.requests == []  # unknown ids are answered here, whoever asks and however often
        # The reads spent the tenant's own request limit, the one its creates take from (refilled since: a few).
        after = call(gw, "POST", "/responses", json={"model": "gpt", "input": "x"})
        assert after.status_code in (200, 429)
        assert int(after.headers["x-ratelimit-remaining-requests"]) < 100
        assert (
            call(gw, "GET", f"/responses/resp_{secrets.token_hex(24)}", OTHER_KEY).status_code == 404
        )  # not the rival's


def test_a_response_made_while_redis_is_down_is_kept_and_written_when_it_is_back(
    redis_server: RedisServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    text = config(upstream.url, redis_server.url, FAST_SIM)
    with gateway_process(text, tmp_path) as one, gateway_process(text, tmp_path) as two:
        redis_server.stop()
        made = create(one)  # generation does not depend on Redis
        rid = made["id"]
        assert call(one, "GET", f"/responses/{rid}").status_code == 200  # its maker knows the owner for certain
        refused(call(one, "GET", f"/responses/{rid}", OTHER_KEY), {404})
        refused(call(two, "GET", f"/responses/{rid}"), {503})  # the other cannot read any owner: fails closed
        redis_server.start()  # empty, on the same port: the kept record is written once it answers
        with redis_server.client() as client:
            wait_until(lambda: client.exists(index_key(rid)), timeout=15, what="the kept owner record written")
        wait_until(lambda: call(two, "GET", f"/responses/{rid}").status_code == 200, timeout=15, what="read on two")

        # Another tenant: 404 once the owner can be read. A call that finds the store slow on a busy machine just
        # after its restart may still fail closed (503, retry-after), as the contract allows: never anything else.
        def answered() -> bool:
            answer = call(two, "GET", f"/responses/{rid}", OTHER_KEY)
            assert answer.status_code in {404, 503}, (answer.status_code, answer.text)
            return answer.status_code == 404

        wait_until(answered, timeout=15, what="a 404 for another tenant on two")
