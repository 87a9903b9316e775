"""Signed webhooks for background jobs, end to end: a real HTTP receiver on loopback, the gateway under uvicorn
and as `sluice serve` processes sharing a real Redis; the signature checked here from the Standard Webhooks
definition, not with the gateway's code.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.auth.keys import new_key
from tests.support.gateway import RunningGateway, gateway_process, gateway_thread
from tests.support.redis import RedisServer
from tests.support.wait import wait_until

SECRET = "whsec_" + base64.b64encode(b"a test secret of 32 bytes or so!").decode()


class Receiver:
    """An HTTP server that records every delivery and answers 500 while `failing`."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes, int]] = []
        self.failing = False
        self.hanging = threading.Event()  # set: requests wait for `released` before answering
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if receiver.hanging.is_set():
                    receiver.got.append(({k.lower(): v for k, v in self.headers.items()}, body, 0))
                    receiver.released.wait(30)
                    return
                status = 500 if receiver.failing else 204
                receiver.got.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> list[tuple[dict[str, str], bytes, int]]:
        return [entry for entry in self.got if entry[2] < 300]

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def config(url: str, extra: str = "", retry_s: float = 0.2) -> str:
    return f"""
backends:
  sim: {{type: simulated, ttft_ms: 10, tpot_ms: 1, tokens: 4}}
models:
  m: {{backend: sim}}
background:
  webhook: {{url: "{url}", secret: "{SECRET}", first_retry_s: {retry_s}, max_retry_s: {retry_s * 4}, timeout_s: 2}}
{extra}
"""


def pending(client: redis.Redis) -> int:
    """The deliveries and watches pending in Redis (the set's marker, never due, left out)."""
    return int(client.zcount("sluice:bg:webhooks", "-inf", "(+inf"))


def verified(headers: dict[str, str], body: bytes, secret: str = SECRET) -> bool:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(part == f"v1,{expected}" for part in headers["webhook-signature"].split(" "))


def start_job(gw: RunningGateway, key: str | None = None) -> str:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    headers = {"x-sluice-background": "true", **({"authorization": f"Bearer {key}"} if key else {})}
    made = httpx.post(f"{gw.base_url}/chat/completions", json=payload, headers=headers)
    assert made.status_code == 202, made.text
    ident: str = made.json()["id"]
    return ident


def test_a_finished_job_posts_one_signed_event(receiver: Receiver) -> None:
    with gateway_thread(config(receiver.url)) as gw:
        ident = start_job(gw)
        wait_until(receiver.delivered, timeout=10, what="the webhook")
        headers, body, _ = receiver.delivered()[0]
        assert verified(headers, body)
        event = orjson.loads(body)
        assert event["type"] == "background.completed"
        assert event["data"]["id"] == ident
        assert event["id"] == headers["webhook-id"]
        assert verified({**headers, "webhook-timestamp": "1"}, body) is False  # the signature covers it


def test_a_failing_receiver_gets_it_again_until_it_takes_it(receiver: Receiver) -> None:
    receiver.failing = True
    with gateway_thread(config(receiver.url)) as gw:
        start_job(gw)
        wait_until(lambda: len(receiver.got) >= 2, timeout=10, what="two failed attempts")
        receiver.failing = False
        wait_until(receiver.delivered, timeout=10, what="the delivery")
    ids = {headers["webhook-id"] for headers, _, _ in receiver.got}
    assert len(ids) == 1  # one event, the same id on every attempt
    assert all(verified(headers, body) for headers, body, _ in receiver.got)


def test_a_pending_delivery_survives_its_gateway(receiver: Receiver, redis_server: RedisServer, tmp_path: Path) -> None:
    receiver.failing = True
    text = config(receiver.url, f'redis: {{url: "{redis_server.url}"}}', retry_s=2.0)
    with gateway_process(text, tmp_path) as first:
        ident = start_job(first)
        wait_until(lambda: receiver.got, timeout=10, what="the first attempt")
    # That instance is gone with its delivery pending in Redis; another one, started later, delivers it.
    receiver.failing = False
    with gateway_process(text, tmp_path):
        wait_until(receiver.delivered, timeout=20, what="the delivery by the second instance")
    headers, body, _ = receiver.delivered()[0]
    assert verified(headers, body)
    assert orjson.loads(body)["data"]["id"] == ident
    assert headers["webhook-id"] == receiver.got[0][0]["webhook-id"]


def test_a_delivery_whose_gateway_was_killed_mid_post_is_made_by_another(
    receiver: Receiver, redis_server: RedisServer, tmp_path: Path
) -> None:
    receiver.hanging.set()  # the first attempt gets no answer: the instance is killed while it waits
    text = config(receiver.url, f'redis: {{url: "{redis_server.url}"}}', retry_s=0.2)
    with gateway_process(text, tmp_path) as first:
        ident = start_job(first)
        wait_until(lambda: receiver.got, timeout=10, what="the first attempt")
        assert first.proc is not None
        first.proc.kill()  # no graceful anything: its claim on the delivery is all that is left of it
        first.proc.wait(10)
    receiver.hanging.clear()
    with gateway_process(text, tmp_path):
        # The claim runs out timeout_s + 5 s after it was made; then this instance takes the delivery.
        wait_until(receiver.delivered, timeout=30, what="the delivery by the second instance")
    headers, body, _ = receiver.delivered()[0]
    assert verified(headers, body)
    assert orjson.loads(body)["data"]["id"] == ident


def test_a_job_whose_gateway_was_killed_mid_run_still_sends_its_event(
    receiver: Receiver, redis_server: RedisServer, tmp_path: Path
) -> None:
    # Killed while the job runs: nobody reports its end, so its watch (stored as it started) comes due on
    # another instance, which finds the owner gone, marks the job failed and sends that event; no read needed.
    text = f"""
backends:
  sim: {{type: simulated, ttft_ms: 10, tpot_ms: 500, tokens: 100}}
models:
  m: {{backend: sim}}
background:
  lease_s: 1
  webhook: {{url: "{receiver.url}", secret: "{SECRET}", first_retry_s: 0.2, max_retry_s: 0.8, timeout_s: 2}}
redis: {{url: "{redis_server.url}"}}
"""
    with redis_server.client() as client, gateway_process(text, tmp_path) as first:
        ident = start_job(first)
        wait_until(lambda: pending(client) == 1, timeout=10, what="the job's watch")
        assert first.proc is not None
        first.proc.kill()
        first.proc.wait(10)
        assert receiver.got == []
        with gateway_process(text, tmp_path):
            wait_until(receiver.delivered, timeout=30, what="the event, sent by the second instance")
            wait_until(lambda: pending(client) == 0, timeout=10, what="the delivery removed")
        headers, body, _ = receiver.delivered()[0]
        assert verified(headers, body)
        event = orjson.loads(body)
        assert (event["type"], event["data"]["id"], event["data"]["status"]) == ("background.failed", ident, "failed")
        assert client.hget(f"sluice:bg:{{{ident}}}:job", "status") == b"failed"


def test_a_tenant_with_a_webhook_of_its_own_gets_its_events_there_signed_with_its_secret(receiver: Receiver) -> None:
    own_key, own_hash = new_key()
    other_key, other_hash = new_key()
    own_secret = "whsec_" + base64.b64encode(b"acme's own secret, 32 bytes long").decode()
    with contextlib.closing(Receiver()) as own:
        text = (
            config(receiver.url)
            + f"""
tenants:
  acme: {{keys: ["{own_hash}"], webhook: {{url: "{own.url}", secret: "{own_secret}", timeout_s: 2}}}}
  globex: {{keys: ["{other_hash}"]}}
plugins: [auth]
"""
        )
        with gateway_thread(text) as gw:
            mine = start_job(gw, own_key)
            wait_until(own.delivered, timeout=10, what="acme's event")
            theirs = start_job(gw, other_key)
            wait_until(receiver.delivered, timeout=10, what="globex's event, at the default webhook")
        (headers, body, _), (default_headers, default_body, _) = own.delivered()[0], receiver.delivered()[0]
        assert orjson.loads(body)["data"]["id"] == mine
        assert orjson.loads(default_body)["data"]["id"] == theirs
        assert verified(default_headers, default_body)
        assert not verified(headers, body)  # not with the default secret: with acme's own
        assert verified(headers, body, own_secret)
        assert [orjson.loads(b)["data"]["tenant"] for _, b, _ in own.got] == ["acme"]  # nobody else's


def test_a_job_that_ends_while_redis_is_stalled_sends_its_event_once_redis_answers(
    receiver: Receiver, redis_server: RedisServer, tmp_path: Path
) -> None:
    text = config(receiver.url, f'redis: {{url: "{redis_server.url}"}}')
    text = text.replace("tpot_ms: 1, tokens: 4", "tpot_ms: 50, tokens: 20")
    with redis_server.client() as client, gateway_process(text, tmp_path) as gw:
        ident = start_job(gw)  # a second of generation
        wait_until(lambda: pending(client) == 1, timeout=10, what="the job's watch")
        redis_server.pause()
        try:  # the fault itself: Redis answers nothing for 2 s, while the job ends
            time.sleep(2.0)
        finally:
            redis_server.resume()
        wait_until(receiver.delivered, timeout=30, what="the event, once Redis answers")
        wait_until(lambda: pending(client) == 0, timeout=10, what="the delivery removed")
        assert "kept until the store takes them" in gw.log_text()  # the stall did cost the job its writes
    events = [orjson.loads(body) for _, body, _ in receiver.delivered()]
    assert {event["id"] for event in events} == {events[0]["id"]}  # one event, however often it came
    assert (events[0]["type"], events[0]["data"]["id"]) == ("background.completed", ident)
    assert all(verified(headers, body) for headers, body, _ in receiver.got)


def test_redis_restarted_empty_loses_pending_deliveries_loudly_and_later_jobs_still_send_theirs(
    receiver: Receiver, redis_server: RedisServer, tmp_path: Path
) -> None:
    receiver.failing = True
    text = config(receiver.url, f'redis: {{url: "{redis_server.url}"}}', retry_s=1.0)
    with redis_server.client() as client, gateway_process(text, tmp_path) as gw:
        lost = start_job(gw)
        wait_until(lambda: receiver.got, timeout=10, what="the first attempt")
        assert pending(client) == 1  # its next attempt, pending in Redis
        redis_server.stop()
        redis_server.start()  # empty: the delivery pending there is gone
        line = "Redis lost the pending deliveries"
        wait_until(lambda: line in gw.log_text(), timeout=30, what="the loss reported")
        assert gw.log_text().count(line) == 1
        receiver.failing = False
        kept = start_job(gw)
        wait_until(receiver.delivered, timeout=30, what="the next job's event")
    delivered = [orjson.loads(body)["data"]["id"] for _, body, _ in receiver.delivered()]
    assert delivered == [kept]
    assert {orjson.loads(body)["data"]["id"] for _, body, _ in receiver.got} == {lost, kept}
