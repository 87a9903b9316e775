"""One endpoint (replica) of a backend: its client, how busy it is, what it was sent, its health record.

upstream/endpoints.py keeps a backend's set of them and decides about ejection; upstream/route.py reads
their load and prefix memory to choose one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from gateway.upstream.connection import PoolError, read_all
from gateway.upstream.http2 import Http2Client
from gateway.upstream.pool import Pool, PoolLimits

if TYPE_CHECKING:
    import ssl

    from gateway.upstream.providers.base import UpstreamResponse

log = logging.getLogger("sluice.upstream")


class Endpoint:
    """One replica: its client, how busy it is, what it has recently been sent, whether it is ejected."""

    __slots__ = (
        "bit",
        "client",
        "ejected_until",
        "ejections",
        "failures",
        "gauge",
        "kv",
        "label",
        "metrics_url",
        "others",
        "pool",
        "probing",
        "running",
        "scraped_at",
        "seen",
        "url",
        "waiting",
    )

    def __init__(self, url: str, limits: PoolLimits, tls: ssl.SSLContext | None, http2: bool) -> None:
        self.url = url
        scheme, _, rest = url.partition("://")
        origin = rest.split("/", 1)[0]
        self.label = origin  # host:port, the `endpoint` label of metrics and spans
        self.metrics_url = f"{scheme}://{origin}/metrics"  # vLLM serves it at the root, not under /v1
        self.pool: Pool | None = None if http2 else Pool(url, limits, tls)
        self.client: Pool | Http2Client = self.pool if self.pool is not None else Http2Client(url, limits, tls)
        self.failures = 0  # consecutive
        self.ejections = 0  # in a row, for the back-off
        self.ejected_until = 0.0  # time.monotonic(); 0: in service
        self.probing = False  # back from an ejection, not yet proven healthy
        self.gauge: Any = None
        # Prefix routing (gateway/upstream/route.py keeps both): block hash -> when it was last sent here, oldest first,
        # and this endpoint's bit in its backend's policy's index of which endpoints hold a block (0: none yet).
        self.seen: OrderedDict[int, float] = OrderedDict()
        self.bit = 0
        # The server's own view (vLLM /metrics), when scraped: requests queued and running, KV-cache usage,
        # and of those the ones others sent (other gateway pods): the count less this process's own then.
        self.waiting = 0.0
        self.running = 0.0
        self.others = 0.0
        self.kv = 0.0
        self.scraped_at = -1e9

    def outstanding(self) -> int:
        """Requests this process has in flight here (HTTP/2: unknown, 0; scraped metrics then decide)."""
        pool = self.pool
        return pool.busy if pool is not None else 0

    def load(self, now: float, fresh_s: float) -> float:
        """In flight here; with fresh server metrics, plus what others had sent it at the scrape.

        Not the server's count as scraped: this process's own part of it is known exactly and now, whereas
        the scrape is up to `metrics_interval_s` old (requests counted then may have finished since)."""
        pool = self.pool
        mine = float(pool.busy) if pool is not None else 0.0
        if now - self.scraped_at <= fresh_s:
            return mine + self.others
        return mine

    def scraped(self, waiting: float, running: float, kv: float, now: float) -> None:
        """The server's counts, just read (HTTP/2: this process's own count is unknown, so all are others')."""
        self.waiting, self.running, self.kv = waiting, running, kv
        self.others = max(0.0, waiting + running - self.outstanding())
        self.scraped_at = now

    def kv_usage(self, now: float, fresh_s: float) -> float:
        return self.kv if now - self.scraped_at <= fresh_s else 0.0

    def set_up(self, up: bool) -> None:
        if self.gauge is not None:
            self.gauge.set(1 if up else 0)

    async def warm(self, probe: bool = False) -> int | str | None:
        """Top the pool up to its warm connections (expired idle ones closed first): how many are idle, or
        what failed. `probe`: open one even when none is kept warm (a backend that is down). HTTP/2 is
        only probed (one cheap request); None when nothing was tried."""
        pool = self.pool
        try:
            if pool is not None:
                pool.expire()
                return await pool.warm(max(pool.limits.warm, 1) if probe else None)
            return await self.client.warm() if probe else None
        except PoolError as exc:
            return str(exc)

    async def aclose(self) -> None:
        await self.client.aclose()


class Primed:
    """A response whose first body chunk was read (to know the endpoint answers); that chunk is handed out first."""

    __slots__ = ("_first", "_response", "acquire_ms", "complete", "headers", "status")

    def __init__(self, response: UpstreamResponse, first: bytes) -> None:
        self._response = response
        self._first: bytes | None = first
        self.status = response.status
        self.headers = response.headers
        self.acquire_ms = response.acquire_ms
        self.complete = response.complete

    async def next_chunk(self) -> bytes:
        first = self._first
        if first is not None:
            self._first = None
            return first
        chunk = await self._response.next_chunk()
        self.complete = self._response.complete
        return chunk

    async def read(self) -> bytes:
        return await read_all(self.next_chunk)

    def close(self) -> None:
        self._response.close()


def parse_load(text: str) -> tuple[float, float, float] | None:
    """(waiting, running, KV-cache usage) from vLLM's /metrics, summed over models; None if absent.

    A line scan, not a Prometheus parser: only the few `vllm:` gauges routing reads are looked at.
    """
    waiting = running = kv = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, brace, rest = line.partition("{")
        if brace:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:num_requests_running":
            running += value
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            kv = max(kv, value)
        else:
            continue
        found = True
    return (waiting, running, kv) if found else None
