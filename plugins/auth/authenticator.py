"""auth: gateway keys -> tenant, resolved from an in-process cache so that a check costs microseconds.

Keys are only ever stored as `sha256:<hex>`: in the config (`tenants.NAME.keys`) and/or in Redis (the hash
`sluice:keys`, field = hex digest, value = {"tenant": ..., "models": [...]}) so that operators add and
revoke keys without a restart (`sluice keys add|revoke`). Lookups go: config keys (a key presented before is
found by its raw bytes, without hashing it again), then the TTL cache
(which also holds negative entries, so a flood of bad keys costs no Redis trips), then Redis, one lookup
per digest at a time. A revocation is published on `sluice:keys`; every process drops its cached entry at
once, and the TTL bounds staleness if that message is lost. A key is never logged: only the first 8 hex
digits of its digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import orjson
from cachetools import TTLCache

from gateway.errors import AuthenticationError, PermissionDeniedError, ServiceUnavailableError
from gateway.plugin import Configured, Empty, Problem, Schema
from gateway.state.store import Store, StoreUnavailable
from gateway.state.subscriber import subscribe
from plugins.auth.config import AuthSection, AuthTenant

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.runtime import Runtime
    from gateway.settings import Settings

log = logging.getLogger("sluice.auth")

KEYS_HASH = "sluice:keys"
CHANNEL = "sluice:keys"
ANONYMOUS = "anonymous"
CACHE_SIZE = 100_000


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    models: frozenset[str] | None  # None: every model


def digest(key: str | bytes) -> str:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key from `Authorization: Bearer KEY`, `api-key: KEY` (AzureOpenAI sends both) or `x-api-key: KEY`
    (Anthropic's SDKs and Claude Code): the first of them in the request's order."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif (name == b"api-key" or name == b"x-api-key") and value.strip():
            return value.strip()
    return None


class Auth:
    name: ClassVar[str] = "auth"
    schema: ClassVar[Schema] = Schema(section=AuthSection, tenant=AuthTenant)

    @classmethod
    def check(
        cls, config: Configured[AuthSection, Empty, AuthTenant], settings: Settings, listed: Sequence[str]
    ) -> Iterable[Problem]:
        for tenant, spec in config.tenants.items():
            for model in spec.models or ():
                if model not in settings.models:
                    yield f"tenants.{tenant}.models", f"no model named {model!r}"

    @classmethod
    def advise(
        cls, config: Configured[AuthSection, Empty, AuthTenant], settings: Settings, listed: Sequence[str]
    ) -> Iterable[Problem]:
        if config.section.required and not settings.redis.url and not any(t.keys for t in config.tenants.values()):
            # Valid, and yet every request would be a 401: keys come only from the config or from Redis.
            yield "plugins", "auth is on with no key in any tenant and no Redis to hold keys: every request gets a 401"

    def __init__(self, config: Configured[AuthSection, Empty, AuthTenant], settings: Settings) -> None:
        self.required = config.section.required
        self.ttl = config.section.cache_ttl_s
        self.configured: dict[str, Principal] = {}
        for tenant, spec in config.tenants.items():
            models = frozenset(spec.models) if spec.models is not None else None
            for key in spec.keys:
                self.configured[key.removeprefix("sha256:").lower()] = Principal(tenant, models)
        self.cache: TTLCache[str, Principal | None] = TTLCache(CACHE_SIZE, self.ttl)
        # Config keys as presented -> (principal, digest prefix). Only a key whose digest is in the config gets
        # in, so it holds at most one entry per configured key whatever clients send.
        self.presented: dict[bytes, tuple[Principal, str]] = {}
        # The same keys by their whole `authorization` value as most clients send it (`Bearer KEY`): the
        # request path then parses no header for them. At most one entry per configured key, as above.
        self.bearers: dict[bytes, tuple[Principal, str]] = {}
        self.pending: dict[str, asyncio.Future[Principal | None]] = {}
        self.store: Store | None = None
        self.lookups = 0  # Redis lookups made, for metrics and tests
        self._listener: asyncio.Task[None] | None = None

    async def startup(self, runtime: Runtime) -> None:
        self.store = runtime.store
        if self.store is not None:
            self._listener = asyncio.get_running_loop().create_task(self._listen(self.store.node_urls))

    async def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener

    async def on_request(self, ex: Exchange) -> None:
        authorization = ex.header(b"authorization")
        if authorization is not None:
            known = self.bearers.get(authorization)
            # With an `api-key` header too, the first of the two counts: presented_key decides.
            if known is not None and ex.header(b"api-key") is None:
                principal, short = known
                if principal.models is None:
                    ex.tenant = principal.tenant
                    ex.state["auth"] = short
                    return
                self._admit(ex, principal, short)
                return
        key = presented_key(ex.headers)
        if key is None:
            if self.required:
                raise AuthenticationError(
                    "You didn't provide an API key: send it as 'Authorization: Bearer KEY', 'api-key: KEY' "
                    "or 'x-api-key: KEY'."
                )
            return
        known = self.presented.get(key)
        if known is None:
            hexdigest = digest(key)
            short = hexdigest[:8]
            found = self.configured.get(hexdigest)
            if found is not None:
                known = self.presented[key] = (found, short)
            else:
                found = await self.resolve(hexdigest)
            if found is None:
                if self.required:
                    raise AuthenticationError(f"Incorrect API key provided (sha256:{short}...).")
                return
            principal = found
        else:
            principal, short = known
            if authorization is not None and authorization == b"Bearer " + key:
                self.bearers[authorization] = known
        self._admit(ex, principal, short)

    @staticmethod
    def _admit(ex: Exchange, principal: Principal, short: str) -> None:
        # A stored object's operation names no model (it is its owner's, read after auth): nothing to allow.
        if principal.models is not None and not ex.resource and ex.model not in principal.models:
            raise PermissionDeniedError(f"tenant {principal.tenant!r} may not use model {ex.model!r}", param="model")
        ex.tenant = principal.tenant
        ex.state["auth"] = short

    async def resolve(self, hexdigest: str) -> Principal | None:
        """A key not in the config: the cache, else one Redis lookup shared by everyone asking meanwhile."""
        try:
            return self.cache[hexdigest]
        except KeyError:
            pass
        if self.store is None:
            return None
        waiting = self.pending.get(hexdigest)
        if waiting is not None:
            return await asyncio.shield(waiting)
        future: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
        self.pending[hexdigest] = future
        try:
            principal = await self._fetch(hexdigest)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: followers may all be gone
            raise
        else:
            future.set_result(principal)
            self.cache[hexdigest] = principal
            return principal
        finally:
            del self.pending[hexdigest]

    async def _fetch(self, hexdigest: str) -> Principal | None:
        assert self.store is not None
        self.lookups += 1
        try:
            raw = await self.store.execute("HGET", KEYS_HASH, hexdigest)
        except StoreUnavailable:
            if not self.required:
                return None
            raise ServiceUnavailableError(
                "The key store is unavailable and this key is not cached; retry shortly.", code="auth_unavailable"
            ) from None
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
            models = record.get("models")
            return Principal(str(record["tenant"]), frozenset(models) if models is not None else None)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            log.warning("key sha256:%s... has a malformed record in redis; refusing it", hexdigest[:8])
            return None

    def _changed(self, name: bytes) -> None:
        self.cache.pop(name.decode(errors="replace"), None)

    async def _listen(self, urls: list[str]) -> None:
        """Drop cached entries named on the channel; after any gap in the subscription, drop them all.

        On a cluster, one node's subscription hears every PUBLISH; after a failure the next seed is tried.
        """
        said = ""  # the last failure logged: one line when the reason changes, not one a second

        def subscribed() -> None:
            nonlocal said
            said = ""
            self.cache.clear()  # messages may have been missed while unsubscribed

        for url in itertools.cycle(urls):
            try:
                await subscribe(url, CHANNEL, subscribed, self._changed)
            except Exception as exc:  # whatever it was, the listener must live: key changes depend on it
                reason = f"{type(exc).__name__}: {exc}"
                if reason != said:
                    log.warning("auth: key-change subscription lost (%s); retrying every second", reason)
                    said = reason
                await asyncio.sleep(1.0)
