"""cache's configuration: its section and a model's overrides. Apart from the plugin so that the plugin's module
can be compiled (mypyc, docs/architecture.md): pydantic models stay interpreted."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.settings import Strict

__all__ = ["CacheMode", "CacheModel", "CacheSection", "ModelCache"]

CacheMode = Literal["deterministic", "always", "off"]


class CacheSection(Strict):
    """`cache:`"""

    ttl_s: float = Field(3600.0, gt=0)
    l1_entries: int = Field(10000, ge=0)
    l1_bytes: int = Field(64 * 1024 * 1024, ge=0)
    max_entry_bytes: int = Field(1024 * 1024, ge=1)  # larger answers are not stored
    stale_s: float = Field(3600.0, ge=0)  # how long past its TTL an entry may still answer when every target fails
    mode: CacheMode = "deterministic"
    max_followers: int = Field(256, ge=0)  # identical in-flight requests sharing one upstream call
    follower_wait_s: float = Field(30.0, gt=0)  # how long a follower waits for the leader's first byte
    # Skip the Redis GET of a key no gateway has announced storing (plugins/cache/presence.py); needs redis.url.
    presence: bool = False
    presence_keys: int = Field(
        1_000_000, ge=1, le=20_000_000
    )  # keys stored fleet-wide in one entry lifetime (ttl + stale)


class ModelCache(Strict):
    """Per-model overrides of the cache policy."""

    mode: CacheMode | None = None
    ttl_s: float | None = Field(None, gt=0)
    shared: bool = False  # entries shared by all tenants (only for models whose answers are not private)


class CacheModel(Strict):
    """Its key under `models.NAME`."""

    cache: ModelCache = ModelCache()
