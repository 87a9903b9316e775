"""`sluice cache`: fill the cache before the first user asks, see what it holds, purge one tenant's entries.

- `prefill FILE`: every line of FILE (JSON Lines) is an OpenAI request body, with an optional `"tenant"`
  (else `--tenant`, else "anonymous"). Each goes through the gateway's own pipeline, built in this process
  from the config with only the cache plugin (and a stage that sets the line's tenant), so its key, its
  policy and its stored form are exactly those a served request gets. The cache looks the entry up first:
  an entry already there is counted "already present" and nothing goes upstream, so a second run costs no
  tokens. Entries are written to Redis (an entry in this process's memory would leave with it), so
  `redis.url` is required. `--dry-run` prints the key each line would fill and sends nothing.
- `stats`: entries and bytes in Redis by tenant and model (from the keys: plugins/cache/layout.py), and
  what each gateway process keeps in memory (L1) by configuration.
- `purge --tenant T [--model M]`: UNLINK every entry of tenant T (of model M): a SCAN of T's key prefix,
  in batches, each key's tenant checked again before it goes. No other tenant's entry can match.
  Gateways keep their in-memory (L1) copies until those expire (`ttl_s`). Every other listed plugin that
  keeps entries (the semantic cache) purges the tenant's too, through its `purge` (gateway/plugin.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

import orjson
import redis
import redis.cluster

from gateway.config import parse, read
from gateway.errors import GatewayError
from gateway.plugin import Configured, Empty, load_class
from gateway.server import request
from gateway.settings import ConfigError, Settings
from gateway.state.resp import node_urls
from gateway.state.store import StoreUnavailable
from plugins.cache import layout
from plugins.cache.exact import Cache, _deterministic

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.runtime import Runtime

STAMP = "plugins.cache.commands:Stamp"
TENANT_HEADER = b"x-sluice-prefill-tenant"
ENDPOINTS = (("messages", "chat/completions"), ("input", "embeddings"), ("prompt", "completions"))
BATCH = 500


class CommandError(Exception):
    """A problem that ends the command with one line and exit code 2 (bad input) or 1 (Redis, upstream)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Stamp:
    """The stage before the cache while prefilling: sets the tenant the line is for."""

    name: ClassVar[str] = "prefill_tenant"

    def __init__(self, _config: object, _settings: Settings) -> None:
        pass

    async def on_request(self, ex: Exchange) -> None:
        ex.tenant = (ex.header(TENANT_HEADER) or b"anonymous").decode()


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    endpoint: str
    tenant: str
    body: bytes


@dataclass(slots=True)
class Counts:
    stored: int = 0
    present: int = 0
    failed: int = 0
    messages: list[str] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.stored + self.present + self.failed


# -- reading the config and the file


def load(path: str | None) -> tuple[Settings, str]:
    """The settings and the cache plugin's spec in `plugins:`."""
    try:
        settings = parse(*read(path))
    except ConfigError as exc:
        raise CommandError("\n".join(f"config error: {line}" for line in exc.lines)) from None
    for spec in settings.plugins:
        if load_class(spec) is Cache:
            return settings, spec
    raise CommandError("the cache plugin is not in the config's `plugins:` list")


def read_lines(path: str, tenant: str | None) -> list[Line]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    lines: list[Line] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"{path}:{number}: not valid JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise CommandError(f"{path}:{number}: expected a request body (a JSON object with a model)")
        owner = body.pop("tenant", None) or tenant or "anonymous"
        endpoint = next((name for key, name in ENDPOINTS if key in body), None)
        if endpoint is None:
            raise CommandError(f"{path}:{number}: no messages, input or prompt: which endpoint is it for?")
        lines.append(Line(number, endpoint, str(owner), orjson.dumps(body)))
    return lines


# -- prefill


def keys(settings: Settings, spec: str, lines: list[Line]) -> Iterator[tuple[Line, str]]:
    """(line, the key it fills, or why it fills none), computed as the cache plugin does, offline."""
    cache = Cache(settings.plugin_config(spec), settings)
    for line in lines:
        try:
            ex = request.parse(line.endpoint, [], line.body, time.perf_counter(), f"prefill-{line.number}")
        except GatewayError as exc:
            yield line, f"not cacheable: {exc.message}"
            continue
        ex.tenant = line.tenant
        policy = cache.policies.get(ex.model)
        if ex.model not in cache.policies:
            yield line, f"not cacheable: no model named {ex.model!r}"
        elif policy is None:
            yield line, f"not cacheable: the cache is off for {ex.model}"
        elif not (policy.always or _deterministic(ex)):
            yield line, "not cacheable: needs temperature 0 or a seed (cache mode deterministic)"
        else:
            yield line, cache.key(ex, policy)


async def prefill(settings: Settings, spec: str, lines: list[Line], concurrency: int, out: TextIO) -> Counts:
    from gateway.runtime import Runtime

    if not settings.redis.url:
        raise CommandError("prefill stores into Redis: set redis.url in the config")
    # The pipeline with the cache alone: no keys to check, no budgets spent, the tenant from the line; and no
    # warm-up or keep-warm requests, which are the serving gateway's business.
    models = {name: m.model_copy(update={"warmup": None, "keep_warm_s": None}) for name, m in settings.models.items()}
    only_cache = settings.model_copy(update={"plugins": [STAMP, spec], "models": models})
    # As gateway/config.py sets it: the validated parts of each listed plugin, here the cache's as configured.
    only_cache._plugin_config = {STAMP: Configured(Empty(), {}, {}), spec: settings.plugin_config(spec)}
    runtime = Runtime(only_cache)
    counts = Counts()
    progress = Progress(out, len(lines))
    try:
        assert runtime.store is not None
        try:
            await runtime.store.execute("PING")
        except StoreUnavailable as exc:
            raise CommandError(f"Redis at {settings.redis.url} is unavailable: {exc}", code=1) from None
        await runtime.start()
        cache = next(p for p in runtime.plugins if isinstance(p, Cache))
        gate = asyncio.Semaphore(concurrency)

        async def one(line: Line) -> None:
            async with gate:
                result = await send(runtime, line)
            if result == "hit":
                counts.present += 1
            elif result == "miss":
                counts.stored += 1
            else:
                counts.failed += 1
                counts.messages.append(f"line {line.number}: {result}")
            progress.show(counts, line, result)

        await asyncio.gather(*(one(line) for line in lines))
        await runtime.pipeline.drain(timeout=60.0)  # the cache's on_complete: it assembles and stores
        await cache.shutdown()  # the Redis writes, before the summary says they were made
        unwritten = counts.stored - cache.stats["stored"]
        if unwritten > 0:  # answered, but not a whole success or too large to keep (max_entry_bytes)
            counts.stored -= unwritten
            counts.failed += unwritten
            counts.messages.append(f"{unwritten} answer(s) not stored: incomplete or larger than max_entry_bytes")
    finally:
        progress.end()
        await runtime.aclose()
    return counts


async def send(runtime: Runtime, line: Line) -> str:
    """Drive one line through the pipeline as an ASGI request; the cache's verdict, or why it failed."""
    headers = [(b"content-type", b"application/json"), (TENANT_HEADER, line.tenant.encode())]
    scope = {"type": "http", "method": "POST", "path": f"/v1/{line.endpoint}", "headers": headers}
    sent = False
    status = 0
    answer: dict[str, bytes] = {}
    parts: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": line.body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves: the pipeline's watcher waits here
        raise AssertionError("unreachable")

    async def collect(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            answer.update((k.decode(), v) for k, v in message["headers"])
        else:
            parts.append(message.get("body", b""))

    await runtime.intake.asgi(runtime.intake.openai, scope, receive, collect, line.endpoint)
    verdict = answer.get("x-sluice-cache", b"").decode()
    if status != 200:
        try:
            error = orjson.loads(b"".join(parts))["error"]["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            error = b"".join(parts)[:200].decode("utf-8", "replace")
        return f"{status}: {error}"
    if verdict == "bypass":
        return "not cacheable: needs temperature 0 or a seed (cache mode deterministic), or the cache is off"
    return verdict or "no cache verdict"


class Progress:
    """An in-place counter on a terminal, a line per request otherwise."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out = out
        self.total = total
        self.tty = out.isatty()

    def show(self, counts: Counts, line: Line, result: str) -> None:
        if self.tty:
            self.out.write(
                f"\r  {counts.done}/{self.total}  stored {counts.stored}  already present {counts.present}  "
                f"failed {counts.failed}"
            )
        else:
            shown = {"hit": "already present", "miss": "stored"}.get(result, f"failed ({result})")
            self.out.write(f"  [{counts.done}/{self.total}] line {line.number} ({line.tenant}): {shown}\n")
        self.out.flush()

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")


# -- stats and purge


def connect(settings: Settings) -> redis.Redis | redis.cluster.RedisCluster:
    url = settings.redis.url
    if not url:
        raise CommandError("no Redis configured (redis.url): the cache is in each gateway's memory only")
    if url.partition("://")[0].lower().endswith("+cluster"):  # redis-py finds the others from one seed
        # SCAN then runs on every master; a tenant's keys share one slot, so UNLINK of a batch is one node's.
        return redis.cluster.RedisCluster.from_url(node_urls(url)[0], socket_timeout=5, socket_connect_timeout=2)
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


def stats(settings: Settings, spec: str, out: TextIO) -> None:
    section = settings.plugin_config(spec).section
    with connect(settings) as r:
        table: dict[tuple[str, str], list[int]] = {}
        scan = r.scan_iter(match=layout.pattern(), count=1000)
        while batch := [key.decode() for _, key in zip(range(BATCH), scan, strict=False)]:
            sizes = r.pipeline(transaction=False)
            for key in batch:
                sizes.strlen(key)
            for key, size in zip(batch, sizes.execute(), strict=True):
                where = layout.parts(key)
                if where is not None:
                    row = table.setdefault(where, [0, 0])
                    row[0] += 1
                    row[1] += int(size)
        old = sum(1 for _ in r.scan_iter(match=layout.OLD_PATTERN, count=1000))
    out.write(f"{'tenant':<24} {'model':<32} {'entries':>9} {'bytes':>12}\n")
    for (tenant, model), (entries, size) in sorted(table.items()):
        out.write(f"{tenant:<24} {model:<32} {entries:>9} {size:>12}\n")
    total = [sum(row[i] for row in table.values()) for i in (0, 1)]
    out.write(f"{'total':<24} {'':<32} {total[0]:>9} {total[1]:>12}\n")
    if old:
        out.write(f"{old} entries in older layouts (sluice:cache:v1:, v2:, no tenant): no longer read; they expire\n")
    out.write(
        f"L1, in each gateway process: up to {section.l1_entries} entries and {section.l1_bytes} bytes; "
        f"ttl {section.ttl_s:g} s (+{section.stale_s:g} s stale), mode {section.mode}\n"
    )


def purge(settings: Settings, tenant: str, model: str | None, out: TextIO) -> int:
    # Other listed plugins that keep entries of their own (the semantic cache) purge theirs through the plugin
    # contract's `purge` (gateway/plugin.py): this command neither knows nor imports them.
    others = [(spec, hook) for spec in settings.plugins if callable(hook := getattr(load_class(spec), "purge", None))]
    scope = f"tenant {tenant}" + (f", model {model}" if model else "")
    removed = 0
    if settings.redis.url or not others:
        with connect(settings) as r:
            scan = r.scan_iter(match=layout.pattern(tenant, model), count=1000)
            while batch := [key.decode() for _, key in zip(range(BATCH), scan, strict=False)]:
                # The pattern already confines the scan to the tenant's prefix; check each key again all the same.
                mine = [
                    k for k in batch if (where := layout.parts(k)) and where[0] == tenant and model in (None, where[1])
                ]
                if mine:
                    removed += int(r.unlink(*mine))
        out.write(f"purged {removed} entries of {scope}\n")
        out.write("gateways keep their in-memory (L1) copies until they expire (cache.ttl_s)\n")
    for spec, hook in others:
        try:
            count, note = hook(settings.plugin_config(spec), settings, tenant, model)
        except Exception as exc:
            raise CommandError(f"{spec}: {exc}", code=1) from None
        removed += count
        out.write(f"{spec}: purged {count} entries of {scope}\n")
        if note:
            out.write(f"{spec}: {note}\n")
    return removed


# -- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("prefill", help="fill the cache from a JSON Lines file of request bodies")
    p.add_argument("file", help='JSON Lines: one OpenAI request body per line, optionally with a "tenant"')
    p.add_argument("-c", "--config", help="YAML config (default: $SLUICE_CONFIG, else ./config/gateway.yaml)")
    p.add_argument("--tenant", help="the tenant of the lines that do not name one (default: anonymous)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--dry-run", action="store_true", help="print the keys the lines would fill, send nothing")
    p = actions.add_parser("stats", help="entries and bytes in Redis by tenant and model")
    p.add_argument("-c", "--config", help="YAML config (default: $SLUICE_CONFIG, else ./config/gateway.yaml)")
    p = actions.add_parser("purge", help="remove one tenant's entries (of one model) from Redis")
    p.add_argument("--tenant", required=True, help='the tenant ("*" for the entries shared by every tenant)')
    p.add_argument("--model", help="only this model's entries")
    p.add_argument("-c", "--config", help="YAML config (default: $SLUICE_CONFIG, else ./config/gateway.yaml)")


def main(args: argparse.Namespace) -> int:
    out = sys.stdout
    try:
        settings, spec = load(args.config)
        if args.action == "stats":
            stats(settings, spec, out)
            return 0
        if args.action == "purge":
            purge(settings, args.tenant, args.model, out)
            return 0
        if args.concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        lines = read_lines(args.file, args.tenant)
        if args.dry_run:
            for line, key in keys(settings, spec, lines):
                out.write(f"line {line.number} ({line.tenant}): {key}\n")
            return 0
        import uvloop

        counts = uvloop.run(prefill(settings, spec, lines, args.concurrency, out))
    except CommandError as exc:
        for text in str(exc).splitlines():
            print(f"sluice cache {args.action}: {text}", file=sys.stderr)
        return exc.code
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        print(f"sluice cache {args.action}: Redis is unavailable: {exc}", file=sys.stderr)
        return 1
    for message in counts.messages:
        out.write(f"  {message}\n")
    out.write(
        f"prefill: {len(lines)} lines: stored {counts.stored}, already present {counts.present}, "
        f"failed {counts.failed}\n"
    )
    return 1 if counts.failed else 0
