"""The pub/sub subscriber (gateway/state/subscriber.py) against a real redis-server and valkey-server: messages in
order, AUTH and SELECT from the URL, and what a stalled, stopped or refusing server does to it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis

from gateway.state.subscriber import SubscriptionLost, subscribe
from tests.support.redis import RedisServer

CHANNEL = "sluice:test"


async def _wait_subscribed(url: str, subscribed: asyncio.Event, got: list[bytes], quiet_s: float = 5.0) -> None:
    await subscribe(url, CHANNEL, subscribed.set, got.append, quiet_s=quiet_s)


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_messages_arrive_in_order_after_the_confirmation(redis_server: RedisServer) -> None:
    async def run() -> list[bytes]:
        subscribed, got = asyncio.Event(), list[bytes]()
        task = asyncio.create_task(_wait_subscribed(redis_server.url, subscribed, got))
        await asyncio.wait_for(subscribed.wait(), 5)
        client = redis_server.client()
        for i in range(50):
            client.publish(CHANNEL, f"key-{i}")
        client.publish("another:channel", "not for us")
        await _until(lambda: len(got) == 50, 5, "50 messages")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    assert asyncio.run(run()) == [f"key-{i}".encode() for i in range(50)]


def test_password_and_database_come_from_the_url(redis_server: RedisServer) -> None:
    redis_server.client().config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/3"
    publisher = redis.Redis(port=redis_server.port, password="s3cret", socket_timeout=2)

    async def run() -> list[bytes]:
        subscribed, got = asyncio.Event(), list[bytes]()
        task = asyncio.create_task(_wait_subscribed(url, subscribed, got))
        await asyncio.wait_for(subscribed.wait(), 5)
        publisher.publish(CHANNEL, "k")
        await _until(lambda: got == [b"k"], 5, "the message")
        task.cancel()
        return got

    assert asyncio.run(run()) == [b"k"]

    async def refused() -> None:
        await subscribe(f"redis://:wrong@127.0.0.1:{redis_server.port}/0", CHANNEL, lambda: None, lambda _: None)

    with pytest.raises(SubscriptionLost, match="refused"):
        asyncio.run(asyncio.wait_for(refused(), 5))
    publisher.config_set("requirepass", "")  # as the fixture found it
    publisher.close()


def test_a_stalled_server_is_noticed_within_two_quiet_periods(redis_server: RedisServer) -> None:
    async def run() -> float:
        subscribed, got = asyncio.Event(), list[bytes]()
        task = asyncio.create_task(_wait_subscribed(redis_server.url, subscribed, got, quiet_s=0.3))
        await asyncio.wait_for(subscribed.wait(), 5)
        await asyncio.sleep(0.5)  # quiet: a PING went out and was answered; the subscription holds
        assert not task.done()
        redis_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(SubscriptionLost, match="PING"):
                await asyncio.wait_for(task, 5)
            return time.monotonic() - started
        finally:
            redis_server.resume()

    assert asyncio.run(run()) < 1.2  # at most two quiet periods (0.6 s) and the scheduler's slack


def test_a_stopped_server_ends_the_subscription_and_a_restarted_one_takes_a_new_one(
    redis_server: RedisServer,
) -> None:
    async def run() -> None:
        subscribed, got = asyncio.Event(), list[bytes]()
        task = asyncio.create_task(_wait_subscribed(redis_server.url, subscribed, got))
        await asyncio.wait_for(subscribed.wait(), 5)
        redis_server.stop()
        with pytest.raises(SubscriptionLost, match="closed"):
            await asyncio.wait_for(task, 5)
        with pytest.raises(ConnectionRefusedError):
            await _wait_subscribed(redis_server.url, asyncio.Event(), [])
        redis_server.start()  # empty, on the same port
        again = asyncio.Event()
        task = asyncio.create_task(_wait_subscribed(redis_server.url, again, got))
        await asyncio.wait_for(again.wait(), 5)
        redis_server.client().publish(CHANNEL, "after")
        await _until(lambda: got == [b"after"], 5, "the message after the restart")
        task.cancel()

    asyncio.run(run())


def test_a_server_that_does_not_speak_resp_is_a_lost_subscription() -> None:
    async def run() -> None:
        async def http(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(http, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(SubscriptionLost, match="does not speak RESP"):
                await asyncio.wait_for(_wait_subscribed(f"redis://127.0.0.1:{port}/0", asyncio.Event(), []), 5)

    asyncio.run(run())


def test_a_failing_handler_ends_the_subscription_with_its_error(redis_server: RedisServer) -> None:
    def handler(message: bytes) -> None:
        raise ValueError(message)

    async def run() -> None:
        subscribed = asyncio.Event()
        task = asyncio.create_task(subscribe(redis_server.url, CHANNEL, subscribed.set, handler))
        await asyncio.wait_for(subscribed.wait(), 5)
        redis_server.client().publish(CHANNEL, "boom")
        with pytest.raises(ValueError, match="boom"):
            await asyncio.wait_for(task, 5)

    asyncio.run(run())
