"""Waiting for a condition, never for a fixed time: poll with a deadline, fail with what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """The predicate's first truthy value, polled every `interval` s; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s: {what or getattr(predicate, '__name__', 'condition')}")
        time.sleep(interval)


async def until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01, what: str = "") -> T:
    """`wait_until` for async tests: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s: {what or getattr(predicate, '__name__', 'condition')}")
        await asyncio.sleep(interval)


async def until_async(check: Callable[[], Awaitable[T]], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Like `until`, for a condition that must itself be awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s")
        await asyncio.sleep(interval)
