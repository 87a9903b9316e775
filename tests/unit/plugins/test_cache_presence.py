"""The cache's presence filter as data: what it says of keys added, heard, never seen, and after its turns."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gateway.config import parse
from gateway.settings import ConfigError
from plugins.cache import layout
from plugins.cache import presence as presence_module
from plugins.cache.presence import DIGITS, Bloom, Presence, announcement, size_for


def key(n: int) -> str:
    return layout.prefix("acme", "chat") + hashlib.sha256(str(n).encode()).hexdigest()


def trusted(keys: int = 10_000) -> Presence:
    presence = Presence(keys, lifetime_s=60.0)
    presence.trusted = True
    return presence


def test_untrusted_filter_says_maybe_to_everything() -> None:
    presence = Presence(10_000, lifetime_s=60.0)
    assert all(presence.maybe(key(n)) for n in range(100))
    assert presence.skipped == 0


def test_added_keys_are_maybe_and_unseen_ones_mostly_skipped() -> None:
    presence = trusted()
    presence.hear(announcement([key(n) for n in range(10_000)], 60))
    assert all(presence.maybe(key(n)) for n in range(10_000))  # no false negatives, ever
    false = sum(presence.maybe(key(n)) for n in range(10_000, 30_000))
    assert false < 20_000 * 0.03  # sized for 1.5 % at 10,000 keys (a power of two: fewer)
    assert presence.skipped == 20_000 - false


def test_announcements_heard_count_as_added() -> None:
    presence = trusted()
    stored = [key(n) for n in range(64)]
    payload = announcement(stored, 59.5)
    assert payload.startswith(b"60:")
    assert len(payload) == len(b"60:") + 64 * DIGITS
    presence.hear(payload)
    assert presence.heard == 64
    assert all(presence.maybe(k) for k in stored)
    assert not presence.maybe(key(10_000_001))  # one absent key, checked to be absent with this size


def test_messages_in_no_format_of_ours_are_ignored_and_counted() -> None:
    presence = trusted()
    for junk in (b"not hex, not fifteen-digit chunks", b"60:" + b"x" * DIGITS, b"sixty:" + b"0" * DIGITS, b""):
        presence.hear(junk)
    assert presence.ignored == 4
    assert presence.heard == 0
    assert presence.trusted  # ignoring them loses nothing: no gateway of ours sends them


def test_a_longer_lived_writer_lengthens_the_generations() -> None:
    presence = trusted()
    presence.hear(announcement([key(1)], 7200))
    assert presence.lifetime_s == 7200
    presence.hear(announcement([key(2)], 10))
    assert presence.lifetime_s == 7200


def test_scanned_keys_count_as_added_and_foreign_keys_are_ignored() -> None:
    presence = trusted()
    presence.found([key(1).encode(), b"sluice:cache:v3:{acme}:chat:not-a-digest!"])
    assert presence.maybe(key(1))


async def test_a_key_lives_two_turns_then_is_forgotten() -> None:
    presence = trusted()
    presence.start()
    try:
        presence.hear(announcement([key(1)], 60))
        presence.rotate()
        assert presence.maybe(key(1))  # in the old generation: it may still live
        presence.rotate()
        assert not presence.maybe(key(1))  # two lifetimes on: its entry has expired
    finally:
        presence.stop()


async def test_generations_turn_on_their_own() -> None:
    presence = Presence(1000, lifetime_s=0.05)
    presence.trusted = True
    presence.start()
    try:
        presence.hear(announcement([key(1)], 0))  # 60 would lengthen the generations to 60 s
        for _ in range(100):
            if not presence.maybe(key(1)):
                break
            await asyncio.sleep(0.02)
        assert not presence.maybe(key(1))
    finally:
        presence.stop()


def test_sizes_are_powers_of_two_of_twelve_bits_a_key() -> None:
    assert size_for(1) == 1 << 16
    assert size_for(1_000_000) == 1 << 24
    bloom = Bloom(size_for(1000))
    assert len(bloom.words) * 32 == size_for(1000)
    bloom.add(12345)
    assert any(bloom.words)
    bloom.clear()
    assert not any(bloom.words)
    assert len(bloom.words) * 32 == size_for(1000)


@pytest.mark.parametrize("redis", ["", "redis://127.0.0.1:6399/0"])
def test_presence_needs_redis(redis: str) -> None:
    text = f"""
backends: {{up: {{type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}}}}
models: {{chat: {{backend: up}}}}
redis: {{url: "{redis}"}}
cache: {{presence: true}}
plugins: [cache]
"""
    if redis:
        assert parse(text, "<test>").plugin_config("cache").section.presence
    else:
        with pytest.raises(ConfigError, match=r"cache\.presence: needs redis\.url"):
            parse(text, "<test>")


async def test_a_subscription_that_does_not_hear_its_own_announcement_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(presence_module, "DEAF_S", 0.05)
    presence = trusted()
    told = announcement([key(1)], 60)
    presence.published(told)
    presence.hear(told)  # heard back: all is well
    await asyncio.sleep(0.1)
    assert presence.trusted
    presence.published(announcement([key(2)], 60))  # never heard back
    await asyncio.sleep(0.1)
    assert not presence.trusted
