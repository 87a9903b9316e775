"""One backend's endpoints (its replicas): a warm pool and a health record each, and the choice between them.

A backend names one `base_url`, a list of `endpoints`, or a DNS name (`discovery`) whose A/AAAA records are
its replicas, as a Kubernetes headless Service gives them; the name is resolved again every `interval_s`:
an address that appears gets a warm pool before it takes traffic, one that disappears stops taking traffic
and is closed once its requests are done.

`Endpoints.send` asks the backend's route policy (gateway/upstream/route.py) for an endpoint and sends there. A
failure before the first chunk of the body (connect error, reset, 5xx, 429) is tried on another endpoint,
each at most once, before the caller sees the last failure and the model's fallback chain is consulted.

Outlier detection follows Envoy's: `consecutive_failures` connect errors, resets or 5xx in a row eject an
endpoint for `base_ejection_s`, doubled for every ejection while it keeps failing (up to `max_ejection_s`).
When the time is up live traffic probes it: one success returns it, one failure ejects it again. At most
`max_ejected_percent` of the endpoints are out at once, and never the last one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.upstream.connection import ConnectError, RemoteProtocolError
from gateway.upstream.pool import PoolLimits
from gateway.upstream.replica import Endpoint, Primed, parse_load

if TYPE_CHECKING:
    import ssl

    from gateway.context import Exchange
    from gateway.settings import RemoteBackend
    from gateway.upstream.health import Health
    from gateway.upstream.providers.base import UpstreamResponse
    from gateway.upstream.route import Policy

log = logging.getLogger("sluice.upstream")

MAINTAIN_INTERVAL_S = 5.0
RETRY_FIRST_S = 1.0  # a backend that is down is retried after this, then twice as long each time...
RETRY_MAX_S = 30.0  # ...up to this
DRAIN_LIMIT_S = 60.0  # a removed endpoint's streams get this long to end before its pool is closed
# Failures that say the endpoint, not the request, is the problem; anything else is not tried elsewhere.
RETRIED_ERRORS = (ConnectError, RemoteProtocolError)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses of `host` (A and AAAA), sorted, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Endpoints:
    """The endpoints of one backend, built at start-up; `send` is the request path."""

    def __init__(
        self,
        name: str,
        backend: RemoteBackend,
        limits: PoolLimits,
        tls: ssl.SSLContext | None,
        health: Health,
        http2: bool = False,
        resolver: Resolver = resolve,
    ) -> None:
        self.name = name
        self.health = health  # the backend's: up while any endpoint answers
        self.limits = limits
        self.tls = tls
        self.http2 = http2
        self.outlier = backend.outlier
        self.discovery = backend.discovery
        self.resolver = resolver
        routing = backend.routing
        urls = [backend.base_url] if backend.base_url is not None else backend.endpoints or []
        self.urls = [url.rstrip("/") for url in urls]
        # Only a choice between endpoints reads their load: one fixed endpoint is never scraped by default.
        choosing = backend.discovery is not None or len(urls) > 1
        vllm = getattr(backend, "type", "") == "vllm"
        self.scrape = routing.metrics if routing.metrics is not None else vllm and choosing
        self.scrape_interval = routing.metrics_interval_s
        self.fresh_s = 3.0 * routing.metrics_interval_s  # older server metrics are ignored
        self.all: list[Endpoint] = []  # built at start(): a pool needs the running loop
        self.live: list[Endpoint] = []  # in service or probing: what the policy picks from
        self.next_return = float("inf")  # when the earliest ejection ends
        self.gauge: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._draining: set[asyncio.Task[None]] = set()

    def _make(self, url: str) -> Endpoint:
        endpoint = Endpoint(url, self.limits, self.tls, self.http2)
        if self.gauge is not None:
            endpoint.gauge = self.gauge.labels(self.name, endpoint.label)
            endpoint.set_up(True)
        return endpoint

    def instrument(self, gauge: Any) -> None:
        """`sluice_endpoint_up{backend,endpoint}`: 1 in service, 0 ejected."""
        self.gauge = gauge
        for endpoint in self.all:
            endpoint.gauge = gauge.labels(self.name, endpoint.label)
            endpoint.set_up(endpoint.ejected_until == 0.0)

    # -- start-up and background work ---------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.discovery is not None:
            await self.refresh()
            if not self.all:
                self.health.mark_down(f"{self.discovery.dns} resolved to no address")
            self._tasks.append(loop.create_task(self._rediscover()))
        else:
            self.all = [self._make(url) for url in self.urls]
            self.live = list(self.all)
            warm = self.limits.warm > 0  # with no warm connections wanted, nothing is opened at start-up
            self._warmed(self.all, await asyncio.gather(*(e.warm(probe=warm) for e in self.all)))
        self._tasks.append(loop.create_task(self._maintain()))
        if self.scrape:
            self._tasks.append(loop.create_task(self._scrape()))

    def _warmed(self, endpoints: list[Endpoint], results: list[int | str | None]) -> bool:
        """Record a warm-up: the backend is up while any endpoint is; an endpoint that failed is ejected."""
        failures = [(e, r) for e, r in zip(endpoints, results, strict=True) if isinstance(r, str)]
        if len(failures) < len(endpoints):
            self.health.mark_up(sum(r for r in results if isinstance(r, int)))
        elif failures:
            self.health.mark_down(failures[0][1])
        now = time.monotonic()
        for endpoint, error in failures:
            if len(self.all) > 1:
                endpoint.failures = max(endpoint.failures, self.outlier.consecutive_failures - 1)
                self.failed(endpoint, f"warm-up failed: {error}", now)
        return not failures

    async def _maintain(self) -> None:
        """Keep every endpoint's warm connections; retry a backend that is down, with back-off."""
        retry = RETRY_FIRST_S
        while True:
            await asyncio.sleep(retry if self.health.down else MAINTAIN_INTERVAL_S)
            down = self.health.down
            endpoints = list(self.all)
            results = await asyncio.gather(*(endpoint.warm(probe=down) for endpoint in endpoints))
            tried = [(e, r) for e, r in zip(endpoints, results, strict=True) if r is not None]
            if tried:
                self._warmed([e for e, _ in tried], [r for _, r in tried])
            retry = min(retry * 2.0, RETRY_MAX_S) if self.health.down else RETRY_FIRST_S

    async def refresh(self) -> None:
        """Resolve the discovery name again: warm and add new addresses, drain the ones gone."""
        assert self.discovery is not None
        spec = self.discovery
        try:
            addresses = await self.resolver(spec.dns, spec.port)
        except OSError as exc:
            kept = len(self.all)
            log.warning("backend %s: cannot resolve %s: %s (keeping %d endpoint(s))", self.name, spec.dns, exc, kept)
            return
        if not addresses:
            log.warning("backend %s: %s has no addresses (keeping %d endpoint(s))", self.name, spec.dns, len(self.all))
            return
        urls = [f"{spec.scheme}://{_host(address)}:{spec.port}{spec.path.rstrip('/')}" for address in addresses]
        known = {endpoint.url: endpoint for endpoint in self.all}
        added = [self._make(url) for url in urls if url not in known]
        gone = [endpoint for url, endpoint in known.items() if url not in set(urls)]
        if not added and not gone:
            return
        results = await asyncio.gather(*(endpoint.warm(probe=self.limits.warm > 0) for endpoint in added))
        self.all = [endpoint for endpoint in self.all if endpoint not in gone] + added
        self._relive(time.monotonic())
        if added:
            self._warmed(added, results)
        for endpoint in gone:
            endpoint.set_up(False)
            task = asyncio.get_running_loop().create_task(self._drain(endpoint))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        log.info(
            "backend %s: %s resolved to %d endpoint(s)%s%s",
            self.name,
            spec.dns,
            len(self.all),
            f", added {', '.join(e.label for e in added)}" if added else "",
            f", removed {', '.join(e.label for e in gone)}" if gone else "",
        )

    async def _rediscover(self) -> None:
        assert self.discovery is not None
        while True:
            await asyncio.sleep(self.discovery.interval_s)
            await self.refresh()

    async def _drain(self, endpoint: Endpoint) -> None:
        deadline = time.monotonic() + DRAIN_LIMIT_S
        try:
            # A poll, not an Event: requests would otherwise pay for signalling one on every completion.
            while endpoint.outstanding() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.5)
        finally:  # at shutdown too, when this is cancelled
            await endpoint.aclose()

    async def _scrape(self) -> None:
        """Every endpoint's vLLM load metrics, once a `metrics_interval_s`; a failed scrape leaves them to age out."""
        import httpx  # off the request path: one small GET per endpoint and interval

        verify: ssl.SSLContext | bool = self.tls if self.tls is not None else True
        async with httpx.AsyncClient(timeout=self.scrape_interval, verify=verify) as client:

            async def one(endpoint: Endpoint) -> None:
                try:
                    response = await client.get(endpoint.metrics_url)
                except httpx.HTTPError:
                    return
                found = parse_load(response.text) if response.status_code == 200 else None
                if found is not None:
                    endpoint.scraped(*found, time.monotonic())

            while True:
                await asyncio.gather(*(one(endpoint) for endpoint in list(self.all)))
                await asyncio.sleep(self.scrape_interval)

    async def aclose(self) -> None:
        for task in [*self._tasks, *self._draining]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._draining, return_exceptions=True)
        await asyncio.gather(*(endpoint.aclose() for endpoint in self.all), return_exceptions=True)

    # -- the request path ---------------------------------------------------------------------------------

    async def send(
        self, ex: Exchange, policy: Policy | None, method: bytes, path: bytes, headers: bytes, body: bytes
    ) -> UpstreamResponse:
        """The first endpoint's answer that is not a retryable failure before its first chunk, or the last failure."""
        all_ = self.all
        if policy is None and len(all_) == 1:  # one endpoint, nothing to choose: no routing work at all
            endpoint = all_[0]
            try:
                only = await endpoint.client.request(method, path, headers, body)
            except RETRIED_ERRORS as exc:
                self.failed(endpoint, str(exc))
                if isinstance(exc, ConnectError):
                    self.health.mark_down(str(exc))
                raise
            if only.status >= 500:
                self.failed(endpoint, f"status {only.status}")
            elif endpoint.failures or endpoint.probing:
                self.succeeded(endpoint)
            if self.health.down:
                self.health.mark_up()
            return only
        now = time.monotonic()
        if now >= self.next_return:
            self._relive(now)
        remaining = list(self.live) if len(self.live) > 0 else list(all_)
        if not remaining:
            raise ConnectError(f"no endpoints: {self.discovery.dns if self.discovery else ''} resolved to none")
        assert policy is not None
        started = time.perf_counter()
        key = policy.key(ex)
        while True:
            endpoint, score = policy.pick(key, remaining, now)
            ex.route_ms += (time.perf_counter() - started) * 1000.0
            ex.routed = (endpoint.label, policy.name, score)
            if ex.route_bias is not None:
                ex.route_bias.sent(ex, endpoint.label)
            response: UpstreamResponse | None = None
            try:
                response = await endpoint.client.request(method, path, headers, body)
                status = response.status
                # Nothing has gone to the client until the first chunk: a replica that dies after its head
                # (killed while the prompt is being prefilled) is still one to try the next endpoint for.
                first = await response.next_chunk() if status < 400 else None
            except RETRIED_ERRORS as exc:
                if response is not None:
                    response.close()
                self.failed(endpoint, str(exc))
                remaining.remove(endpoint)
                if not remaining:
                    if isinstance(exc, ConnectError):
                        self.health.mark_down(str(exc))
                    raise
                log.info("backend %s: %s failed (%s), trying another endpoint", self.name, endpoint.label, exc)
            except BaseException:
                if response is not None:
                    response.close()
                raise
            else:
                if status < 500 and status != 429:
                    if endpoint.failures or endpoint.probing:
                        self.succeeded(endpoint)
                    if self.health.down:
                        self.health.mark_up()
                    policy.served(key, endpoint, now)
                    return response if first is None else Primed(response, first)
                if status >= 500:
                    self.failed(endpoint, f"status {status}")
                remaining.remove(endpoint)
                if not remaining:
                    return response  # the caller maps it, and may try the next model
                response.close()
                log.info("backend %s: %s answered %d, trying another endpoint", self.name, endpoint.label, status)
            started = time.perf_counter()
            now = time.monotonic()

    def report(self) -> list[dict[str, object]]:
        """Each endpoint's state for /status: in service, ejected (and for how long yet) or probing."""
        now = time.monotonic()
        return [
            {
                "endpoint": endpoint.label,
                "state": "ejected" if endpoint.ejected_until > now else "probing" if endpoint.probing else "up",
                "ejected_for_s": round(endpoint.ejected_until - now, 1) if endpoint.ejected_until > now else None,
                "ejections_in_a_row": endpoint.ejections,
                "consecutive_failures": endpoint.failures,
                "in_flight": endpoint.outstanding(),
            }
            for endpoint in self.all
        ]

    # -- outlier detection --------------------------------------------------------------------------------

    def failed(self, endpoint: Endpoint, reason: str, now: float | None = None) -> None:
        endpoint.failures += 1
        if endpoint.probing or endpoint.failures >= self.outlier.consecutive_failures:
            self._eject(endpoint, reason, time.monotonic() if now is None else now)

    def succeeded(self, endpoint: Endpoint) -> None:
        endpoint.failures = 0
        if endpoint.probing:
            endpoint.probing = False
            endpoint.ejections = 0
            endpoint.set_up(True)
            log.info("backend %s: endpoint %s returned to service", self.name, endpoint.label)

    def _eject(self, endpoint: Endpoint, reason: str, now: float) -> None:
        if endpoint.ejected_until > now or endpoint not in self.all:
            return
        out = sum(1 for e in self.all if e.ejected_until > now)
        spec = self.outlier
        if out + 1 > len(self.all) * spec.max_ejected_percent / 100.0 or out + 1 >= len(self.all):
            return  # keep serving from it: an ejection here would leave too few (or no) endpoints
        seconds = min(spec.max_ejection_s, spec.base_ejection_s * 2.0**endpoint.ejections)
        endpoint.ejections += 1
        endpoint.ejected_until = now + seconds
        endpoint.probing = False
        endpoint.failures = 0
        endpoint.set_up(False)
        self._relive(now)
        log.warning(
            "backend %s: endpoint %s ejected for %gs after %s (ejection %d in a row)",
            self.name,
            endpoint.label,
            seconds,
            reason,
            endpoint.ejections,
        )

    def _relive(self, now: float) -> None:
        """The endpoints to pick from: in service, or back from an ejection whose time is up (probing)."""
        live = []
        next_return = float("inf")
        for endpoint in self.all:
            if endpoint.ejected_until > now:
                next_return = min(next_return, endpoint.ejected_until)
                continue
            if endpoint.ejected_until:
                endpoint.ejected_until = 0.0
                endpoint.probing = True
            live.append(endpoint)
        self.live = live
        self.next_return = next_return


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
