"""The cache's Redis key layout: tenant and model in clear, one prefix per tenant, no way out of it."""

from __future__ import annotations

import fnmatch

import pytest

from plugins.cache import layout

DIGEST = "0123456789abcdef" * 4


@pytest.mark.parametrize("tenant", ["acme", "a*", "a}:b", "x{y", "with space", "ünï", "*"])
@pytest.mark.parametrize("model", ["chat", "llama3.2:1b", "a/b*"])
def test_parts_round_trip(tenant: str, model: str) -> None:
    key = layout.prefix(tenant, model) + DIGEST
    assert layout.parts(key) == (tenant, model)
    assert key.startswith(layout.ROOT + "{")
    assert key.count("{") == 1
    assert key.count("}") == 1


def redis_match(pattern: str, key: str) -> bool:
    # Redis MATCH is glob-style with backslash escapes; fnmatch has none, so make the escaped `*` a class.
    return fnmatch.fnmatchcase(key, pattern.replace("\\*", "[*]"))


def test_a_tenants_pattern_matches_its_keys_only() -> None:
    tenants = ["a", "a*", "ab", "a}:b", "*", "a:b"]
    keys = {tenant: layout.prefix(tenant, "chat") + DIGEST for tenant in tenants}
    for tenant in tenants:
        matched = [t for t, key in keys.items() if redis_match(layout.pattern(tenant), key)]
        assert matched == [tenant]
    assert redis_match(layout.pattern("a", "chat"), keys["a"])
    assert not redis_match(layout.pattern("a", "chat-2"), keys["a"])
    assert all(redis_match(layout.pattern(), key) for key in keys.values())


def test_anything_else_is_not_a_v2_key() -> None:
    assert layout.parts("sluice:cache:v1:" + DIGEST) is None
    assert layout.parts("sluice:cache:v3:acme:chat:" + DIGEST) is None
    assert layout.parts("sluice:cache:v2:" + DIGEST) is None
