"""`sluice keys`: make gateway keys and manage the Redis key store that the auth plugin reads.

A key is shown once, when made; only its sha256 is ever stored. Changes are published on the
`sluice:keys` channel so that every gateway process drops its cached entry at once.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys

import orjson
import redis
import redis.cluster

from gateway.config import load
from gateway.settings import ConfigError, Settings
from gateway.state.resp import node_urls
from plugins.auth.authenticator import CHANNEL, KEYS_HASH  # where the auth plugin reads keys and hears of changes

PREFIX = "sk-sluice-"


def new_key() -> tuple[str, str]:
    key = PREFIX + secrets.token_urlsafe(32)
    return key, "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def hex_digest(key: str | None, hashed: str | None) -> str:
    if key:
        return hashlib.sha256(key.encode()).hexdigest()
    if hashed:
        value = hashed.removeprefix("sha256:").lower()
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
            return value
    sys.exit("sluice keys: give --key KEY or --hash sha256:<64 hex digits>")


def client(url: str) -> redis.Redis | redis.cluster.RedisCluster:
    if not url:
        sys.exit("sluice keys: no Redis configured: pass --redis URL or a config with redis.url")
    if url.partition("://")[0].lower().endswith("+cluster"):  # redis-py finds the others from one seed
        return redis.cluster.RedisCluster.from_url(node_urls(url)[0], socket_timeout=2, socket_connect_timeout=2)
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def new(tenant: str) -> None:
    key, hashed = new_key()
    print(f"key:    {key}")
    print(f"hash:   {hashed}")
    print(f"tenant: {tenant}")
    print(
        "Keep the key secret; it is not stored anywhere. Put the hash in tenants.<name>.keys, or run "
        "`sluice keys add --tenant NAME --hash HASH` to add it to Redis."
    )


def add(url: str, tenant: str, hexdigest: str, models: list[str] | None) -> None:
    record = {"tenant": tenant, "models": models}
    with client(url) as r:
        r.hset(KEYS_HASH, hexdigest, orjson.dumps(record))
        r.publish(CHANNEL, hexdigest)
    print(f"added sha256:{hexdigest[:8]}... for tenant {tenant}")


def revoke(url: str, hexdigest: str) -> bool:
    """True if the key was in Redis and is gone from every process within the auth cache's TTL (sooner by pub/sub)."""
    with client(url) as r:
        removed = bool(r.hdel(KEYS_HASH, hexdigest))
        r.publish(CHANNEL, hexdigest)
    if removed:
        print(f"revoked sha256:{hexdigest[:8]}...")
    return removed


def config_tenant(settings: Settings, hexdigest: str) -> str | None:
    """The tenant whose `tenants.NAME.keys` in the config holds this digest, if any."""
    try:
        config = settings.plugin_config("auth")
    except KeyError:
        return None
    for tenant, spec in config.tenants.items():
        if any(key.removeprefix("sha256:").lower() == hexdigest for key in spec.keys):
            return str(tenant)
    return None


def list_keys(url: str) -> None:
    with client(url) as r:
        entries = r.hgetall(KEYS_HASH)
    if not entries:
        print(f"no keys in Redis at {url} (keys in the config's tenants.NAME.keys are not listed here)")
    for field, value in sorted(entries.items()):
        record = orjson.loads(value)
        models = ",".join(record.get("models") or []) or "*"
        print(f"sha256:{field.decode()[:8]}...  tenant={record.get('tenant')}  models={models}")


ACTIONS: dict[str, str] = {
    "new": "print a fresh key and its sha256 hash, for a tenant's `keys` in the config (nothing is stored)",
    "add": "store a key's hash in Redis for a tenant, effective at once in every gateway",
    "revoke": "remove a key from Redis; every gateway drops it within a second (pub/sub), at most the cache TTL",
    "list": "list the keys stored in Redis: their hashes, tenants and models",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # One sub-command per action, so that `sluice keys new --help` shows what `new` takes, not every action's options.
    actions = parser.add_subparsers(dest="action", required=True, metavar="{new,add,revoke,list}")
    for action, text in ACTIONS.items():
        sub = actions.add_parser(action, help=text, description=text)
        if action in ("new", "add"):
            sub.add_argument("--tenant", required=True, help="the tenant the key belongs to")
        if action in ("add", "revoke"):
            sub.add_argument("--key", help="the key itself")
            sub.add_argument("--hash", help="the key's sha256:... (instead of --key)")
        if action == "add":
            sub.add_argument("--models", help="comma-separated models the key may use (default: all)")
        if action != "new":
            sub.add_argument("--redis", help="Redis URL (default: redis.url from the config)")
            sub.add_argument("-c", "--config", help="YAML config, for redis.url and the config's own keys")


def main(args: argparse.Namespace) -> int:
    if args.action == "new":
        new(args.tenant)
        return 0
    url = args.redis
    settings = None
    if url is None or args.action == "revoke":
        try:
            settings = load(args.config)
        except ConfigError as exc:
            if url is None:
                for line in exc.lines:
                    print(f"sluice keys: config error: {line}", file=sys.stderr)
                return 2
        if url is None:
            assert settings is not None
            url = settings.redis.url
    try:
        if args.action == "list":
            list_keys(url)
            return 0
        hexdigest = hex_digest(args.key, args.hash)
        if args.action == "add":
            models = [m for m in args.models.split(",") if m] if args.models else None
            add(url, args.tenant, hexdigest, models)
        elif not revoke(url, hexdigest):
            tenant = config_tenant(settings, hexdigest) if settings is not None else None
            if tenant is not None:
                print(
                    f"sluice keys revoke: sha256:{hexdigest[:8]}... is a key of tenant {tenant!r} in the config "
                    f"({settings.source if settings else 'the config'}), not in Redis: remove it from "
                    f"tenants.{tenant}.keys and restart the gateway; until then it keeps working",
                    file=sys.stderr,
                )
            else:
                print(f"sluice keys revoke: sha256:{hexdigest[:8]}... is not in Redis at {url}", file=sys.stderr)
            return 1
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as lost:  # one type a name, compiled
        print(f"sluice keys: Redis at {url} is unavailable: {lost}", file=sys.stderr)
        return 1
    return 0
