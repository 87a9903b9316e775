"""Backends and the attempt loop: try `ex.targets` in order until one answers with a first chunk.

Before anything has gone to the client a target may still be abandoned for the next one: a transport
failure, a 429 or a 5xx, or no first chunk within the model's `first_token_deadline_ms`. A 4xx other than
429 is the client's problem and is answered as is. Once `open()` returns, the response is committed:
what happens after is the relay's business (server/relay.py), never a retry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import errors
from gateway.context import Target
from gateway.simulation.answers import Profile
from gateway.upstream import connection
from gateway.upstream.connection import DescriptorsExhausted, PoolError, PoolTimeout
from gateway.upstream.descriptors import soft_limit
from gateway.upstream.providers.anthropic import AnthropicProvider
from gateway.upstream.providers.azure import AzureProvider
from gateway.upstream.providers.base import UpstreamResponse
from gateway.upstream.providers.http import HttpProvider
from gateway.upstream.providers.llamacpp import LlamaCppProvider
from gateway.upstream.providers.ollama import OllamaProvider
from gateway.upstream.providers.openai import OpenAIProvider
from gateway.upstream.providers.simulated import SimulatedProvider
from gateway.upstream.providers.tgi import TGIProvider
from gateway.upstream.providers.vllm import VLLMProvider
from gateway.wire.marks import stream_rules

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.settings import (
        AnthropicBackend,
        AzureBackend,
        LlamaCppBackend,
        OllamaBackend,
        OpenAIBackend,
        PoolSettings,
        Settings,
        TGIBackend,
        VLLMBackend,
    )

    HttpBackend = (
        OpenAIBackend | AzureBackend | VLLMBackend | TGIBackend | LlamaCppBackend | OllamaBackend | AnthropicBackend
    )
    from gateway.telemetry.metrics import Meter
    from gateway.upstream.providers.base import Provider

log = logging.getLogger("sluice.upstream")

RETRYABLE = frozenset({408, 429, 500, 502, 503, 504, 529})  # 529: Anthropic's API is overloaded
ERROR_BODY_LIMIT = 64 * 1024
# An upstream's advice the client's SDK acts on (its retry back-off), kept when its error is passed on.
PASSED_ON_ERROR = frozenset({b"retry-after", b"retry-after-ms", b"x-should-retry"})


@dataclass(slots=True, init=False)  # __init__ written out: compiled, a dataclass's own is interpreted
class Opened:
    """A committed upstream answer: its head, and what of the body was read before committing."""

    # Its fields' types are imported at run time, not only for the type checker: compiled, the dataclass
    # reads them when the module loads.

    response: UpstreamResponse
    first: bytes
    token_at: float  # perf_counter() when the first token was seen, if it was looked for

    def __init__(self, response: UpstreamResponse, first: bytes, token_at: float = 0.0) -> None:
        self.response = response
        self.first = first
        self.token_at = token_at


class Plan:
    """The attempts `open` makes: the targets in order, then round again while the budget lasts."""

    __slots__ = ("budget", "hedging", "next", "targets")

    def __init__(self, targets: list[Target], budget: int, hedging: bool) -> None:
        self.targets = targets
        self.budget = budget
        self.hedging = hedging  # on the first pass, each target is paired with the next one as its hedge
        self.next = 0

    def __iter__(self) -> Iterator[tuple[Target, Target | None, int]]:
        """Each attempt: its target; the one raced against it when it has no first token soon enough; its
        round (0 on the first pass over the targets; each later round waits first). Tuples, not objects: one
        is made for every request."""
        count = len(self.targets)
        while self.next < self.budget:
            index = self.next
            self.next += 1
            hedge = self.targets[index + 1] if self.hedging and index + 1 < count else None
            yield self.targets[index % count], hedge, index // count

    def skip(self) -> None:
        """The next target has been tried already (it was the hedge)."""
        self.next += 1


def build_http(name: str, backend: HttpBackend, pool: PoolSettings) -> HttpProvider:
    if backend.type == "azure":
        return AzureProvider(name, backend, pool)
    if backend.type == "vllm":
        return VLLMProvider(name, backend, pool)
    if backend.type == "tgi":
        return TGIProvider(name, backend, pool)
    if backend.type == "llamacpp":
        return LlamaCppProvider(name, backend, pool)
    if backend.type == "ollama":
        return OllamaProvider(name, backend, pool)
    if backend.type == "anthropic":
        return AnthropicProvider(name, backend, pool)
    return OpenAIProvider(name, backend, pool)


class Upstreams:
    """Every backend's provider and every public model's targets, built once at start-up."""

    def __init__(self, settings: Settings) -> None:
        self.providers: dict[str, Provider] = {}
        # The HTTP backends' providers as their own class, for what writes their requests itself (the Messages
        # API passes a client's bytes through to a backend that serves that API).
        self.http: dict[str, HttpProvider] = {}
        for name, backend in settings.backends.items():
            if backend.type == "simulated":
                failures = tuple((backend.failures or {}).items())  # a scripted failure mix, if any
                profile = Profile(backend.ttft_ms, backend.tpot_ms, backend.tokens, failures=failures)
                self.providers[name] = SimulatedProvider(profile, name)
            else:
                self.providers[name] = self.http[name] = build_http(name, backend, settings.pool)
        self.targets: dict[str, Target] = {
            model: Target(
                model=model,
                backend=spec.backend,
                upstream_model=spec.upstream_model or model,
                settings=spec,
                provider=self.providers[spec.backend],
            )
            for model, spec in settings.models.items()
        }
        # The primary then its fallback chain, each model once: the default order of `ex.targets`.
        self.chains: dict[str, tuple[Target, ...]] = {model: self._chain(model) for model in self.targets}
        # Backends loading their model (kept by gateway/upstream/warmup.py): their models' requests try fallbacks first.
        self.loading: set[str] = set()
        self.out_of_descriptors = 0  # upstream connections this process could not open: no descriptor left
        self.said_at = -math.inf

    def descriptors_exhausted(self) -> None:
        """Counted, and said at most every ten seconds: once at the limit, every new stream meets it."""
        self.out_of_descriptors += 1
        now = time.monotonic()
        if now - self.said_at >= 10.0:
            self.said_at = now
            log.warning(
                "out of file descriptors (soft limit %d; each open stream holds two): requests answered 503 "
                "(%d so far); raise the limit (LimitNOFILE, ulimit -n) or add workers",
                soft_limit(),
                self.out_of_descriptors,
            )

    def _chain(self, model: str) -> tuple[Target, ...]:
        order: list[str] = []
        pending = [model]
        while pending:
            name = pending.pop(0)
            if name not in order:
                order.append(name)
                pending.extend(self.targets[name].settings.fallback)
        return tuple(self.targets[name] for name in order)

    def instrument(self, meter: Meter) -> None:
        """The endpoints' health gauge, in the gateway's registry; with several workers, up only if up in all."""
        gauge = meter.gauge(
            "sluice_endpoint_up",
            "1 while a backend's endpoint (replica) is in service, 0 while it is ejected or removed.",
            ("backend", "endpoint"),
            mode="livemin",
        )
        for provider in self.providers.values():
            provider.instrument(gauge)

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in self.providers.values()))

    @property
    def ready(self) -> bool:
        """Every backend's warm-up has been attempted (up or down: readiness is not the upstreams' health)."""
        return all(p.ready for p in self.providers.values())

    def report(self) -> dict[str, dict[str, object]]:
        return {name: provider.report() for name, provider in self.providers.items()}

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in self.providers.values()), return_exceptions=True)

    async def open(self, ex: Exchange) -> Opened:
        """The first target that answers; raises the last failure when none does within the budget.

        Targets are tried in order. Once each has been tried, a budget left over (`max_attempts`) goes round
        again, after the last failure's `retry-after` (if it is short enough) or a jittered back-off.
        """
        spec = self.targets[ex.model].settings
        targets = ex.targets
        for target in targets:
            if target.provider.health.down:  # known down: the others first, it only as a last resort
                targets = [t for t in targets if not t.provider.health.down] + [
                    t for t in targets if t.provider.health.down
                ]
                break
        plan = Plan(targets, spec.max_attempts or len(targets), ex.hedge_after_ms is not None)
        failure: errors.GatewayError | None = None
        for target, hedge, round_ in plan:
            if round_:
                assert failure is not None
                wait = _retry_wait(failure, round_, spec.max_retry_wait_ms / 1000.0)
                if wait is None:
                    break
                await asyncio.sleep(wait)
            started = time.perf_counter()
            failed: errors.GatewayError | None = None
            try:
                if hedge is not None:
                    opened, target = await self._hedged(ex, target, hedge, ex.hedge_after_ms or 0.0)
                elif ex.stream and target.settings.first_token_deadline_ms is not None:
                    opened = await self._attempt(ex, target)
                else:  # no deadline, no hedge: the attempt in this frame, one fewer that a waiting request holds
                    try:
                        opened = await self._first(ex, target, False)
                    except PoolError as lost:  # named apart: compiled, a name bound by two clauses has one type
                        raise self._pool_failure(lost, target) from None
            except errors.GatewayError as exc:
                ex.attempts.append((target.model, (time.perf_counter() - started) * 1000.0, exc.status))
                if not _retryable(exc):
                    raise
                failed = exc
            finally:
                ex.upstream_ms += (time.perf_counter() - started) * 1000.0
            # A failure is handled after the `finally` rather than by a `continue` inside it: mypyc cannot compile that.
            if failed is not None:
                failure = failed
                if hedge is not None and ex.hedged:
                    plan.skip()  # the hedge was tried too
                log.info(
                    "model %s on %s failed (%s: %s)",
                    target.model,
                    target.backend,
                    failed.status,
                    failed.detail or failed.message,
                )
                continue
            ex.attempts.append((target.model, (time.perf_counter() - started) * 1000.0, 0))
            _served(ex, opened, target, failure)
            return opened
        assert failure is not None
        raise failure

    async def once(self, ex: Exchange, target: Target) -> Opened:
        """One attempt on one target, without deadlines, hedging or another try: an operation on what that
        target stored (a stored response read, cancelled or deleted), which no other target could serve."""
        ex.targets = [target]
        started = time.perf_counter()
        try:
            opened = await self._first(ex, target, False)
        except PoolError as exc:
            raise self._pool_failure(exc, target) from None
        finally:
            ex.upstream_ms += (time.perf_counter() - started) * 1000.0
        _served(ex, opened, target, None)
        return opened

    async def _hedged(self, ex: Exchange, first: Target, second: Target, after_ms: float) -> tuple[Opened, Target]:
        """`first`, and `second` too if `first` has no first token after `after_ms`; the faster one wins."""
        loop = asyncio.get_running_loop()
        primary = loop.create_task(self._attempt(ex, first, until_token=True))
        racing = {primary: first}
        try:
            await asyncio.wait(racing, timeout=after_ms / 1000.0)
            if primary.done():
                return primary.result(), first
            ex.hedged = True
            racing[loop.create_task(self._attempt(ex, second, until_token=True))] = second
            return await _race(racing)
        finally:
            for task in racing:
                if not task.done():
                    task.cancel()  # the loser: _first closes its upstream request when cancelled
                    task.add_done_callback(_close_late_winner)

    async def _attempt(self, ex: Exchange, target: Target, until_token: bool = False) -> Opened:
        deadline = target.settings.first_token_deadline_ms if ex.stream else None
        until_token = ex.stream and (until_token or deadline is not None)
        try:
            if deadline is None:
                return await self._first(ex, target, until_token)
            return await asyncio.wait_for(self._first(ex, target, until_token), deadline / 1000.0)
        except TimeoutError:
            raise errors.UpstreamTimeoutError(
                f"model {target.model!r}: no first token within {deadline:g} ms", code="first_token_deadline"
            ) from None
        except PoolError as exc:
            raise self._pool_failure(exc, target) from None

    def _pool_failure(self, exc: PoolError, target: Target) -> errors.GatewayError:
        """A transport failure as the client's error; a full pool or no descriptor left noted where they count."""
        if isinstance(exc, PoolTimeout):
            target.provider.health.exhausted()
        elif isinstance(exc, DescriptorsExhausted):
            self.descriptors_exhausted()
        return from_pool_error(exc, target.backend, target.model)

    async def _first(self, ex: Exchange, target: Target, until_token: bool) -> Opened:
        response = await target.provider.send(ex, target)
        try:
            if response.status >= 400:
                body = await _read_bounded(response)
                error = errors.from_upstream(response.status, body, target.backend, target.model)
                if error.code == "upstream_auth_failed":
                    log.warning("backend %s refused the gateway's credential (%s)", target.backend, response.status)
                error.headers = [(k, v) for k, v in response.headers if k in PASSED_ON_ERROR]
                raise error
            if not ex.stream:
                # A whole answer is read before anything is sent, so that a body cut short is still a clean
                # 502 rather than a truncated 200.
                body = await response.read()
                if not _is_json_object(body):
                    raise errors.not_json(target.backend)  # 502: the next target is tried; never cached
                return Opened(response, body)
            first = await response.next_chunk()
            if not until_token:
                return Opened(response, first)  # a stream commits at its first chunk
            # With a deadline or a hedge the stream commits at its first token: a role-only chunk or Azure's
            # preamble says nothing about whether the model is generating.
            parts = [first]
            first_token = stream_rules(ex.endpoint).first_token
            while first and not first_token.search(first):
                first = await response.next_chunk()
                parts.append(first)
            return Opened(response, b"".join(parts), time.perf_counter() if first else 0.0)
        except BaseException:
            response.close()  # cancelled by the deadline, or failed: the upstream request ends here
            raise


def around_loading(ex: Exchange, loading: set[str]) -> None:
    """Targets on a backend that is loading its model go last; the request is marked a "loading" fallback."""
    targets = ex.targets
    ready = [t for t in targets if t.backend not in loading]
    if ready and len(ready) < len(targets):
        ex.targets = ready + [t for t in targets if t.backend in loading]
        if ready[0] is not targets[0]:
            ex.fallback = "loading"


def _served(ex: Exchange, opened: Opened, target: Target, failure: errors.GatewayError | None) -> None:
    """Record which target served and, when it was not the first, why."""
    ex.pool_ms = opened.response.acquire_ms
    ex.served = target
    if target is not ex.targets[0] and ex.fallback is None:
        if ex.hedged:
            ex.fallback = "hedge"
        elif isinstance(failure, errors.UpstreamTimeoutError):
            ex.fallback = "deadline"
        else:
            ex.fallback = "error"


async def _race(racing: dict[asyncio.Task[Opened], Target]) -> tuple[Opened, Target]:
    """The first attempt to succeed, with its target; the last failure when every one fails."""
    pending = set(racing)
    failure: BaseException | None = None
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        won = [task for task in done if task.exception() is None]
        if won:
            for tie in won[1:]:
                tie.result().response.close()
            return won[0].result(), racing[won[0]]
        failure = next(iter(done)).exception()
    assert failure is not None
    raise failure


def _close_late_winner(task: asyncio.Task[Opened]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().response.close()


def _retry_wait(failure: errors.GatewayError, round_: int, max_wait: float) -> float | None:
    """Seconds to wait before trying targets again: the upstream's retry-after if short enough, else back-off."""
    for name, value in failure.headers:
        try:
            if name == b"retry-after-ms":
                advised = float(value) / 1000.0
            elif name == b"retry-after":
                advised = float(value)
            else:
                continue
        except ValueError:
            continue
        return float(advised) + random.uniform(0.0, 0.05) if advised <= max_wait else None
    return min(max_wait, 0.1 * 2.0 ** (round_ - 1)) * random.uniform(0.5, 1.0)


def _is_json_object(body: bytes) -> bool:
    """Whether a whole answer is framed as a JSON object: `{` ... `}` around optional whitespace.

    Every OpenAI answer is an object, so an HTML error page, a proxy's text or a body cut short fails this.
    A full parse would also catch garbage between the braces, but costs ~77 µs on a 30 kB embedding (2.4 µs on
    a 700-byte chat answer) against ~0.3 µs for this, on every request.
    """
    head = body[:1] if body[:1] == b"{" else body.lstrip()[:1]  # strip (a copy) only when needed
    tail = body[-1:] if body[-1:] == b"}" else body.rstrip()[-1:]
    return head == b"{" and tail == b"}"


def _retryable(exc: errors.GatewayError) -> bool:
    return exc.status in RETRYABLE


async def _read_bounded(response: UpstreamResponse) -> bytes:
    parts: list[bytes] = []
    size = 0
    try:
        while size < ERROR_BODY_LIMIT and (chunk := await response.next_chunk()):
            parts.append(chunk)
            size += len(chunk)
    except PoolError:
        pass  # the status is what matters; a body cut short is quoted as far as it came
    return b"".join(parts)


def from_pool_error(exc: connection.PoolError, backend: str, model: str | None = None) -> errors.GatewayError:
    """A transport failure as the client's status and a generic message; its detail (addresses, errno) is
    kept in `detail`, for the log only."""
    what = f"model {model!r}" if model is not None else f"backend {backend!r}"
    error: errors.GatewayError
    if isinstance(exc, connection.ConnectTimeout):
        error = errors.UpstreamTimeoutError(
            f"{what}: the upstream did not accept a connection in time", code="connect_timeout"
        )
    elif isinstance(exc, connection.ConnectError):
        error = errors.UpstreamError(f"{what}: the upstream could not be reached", code="connect_error")
    elif isinstance(exc, connection.DescriptorsExhausted):
        # The gateway's own limit, not the backend's failure: each open stream holds two descriptors.
        error = errors.ServiceUnavailableError(
            "the gateway is at its limit of open connections; please try again shortly", code="gateway_overloaded"
        )
    elif isinstance(exc, connection.PoolTimeout):
        error = errors.ServiceUnavailableError(
            f"{what}: every connection to the upstream is busy; please try again shortly",
            code="upstream_pool_exhausted",
        )
    elif isinstance(exc, connection.ReadTimeout):
        error = errors.UpstreamTimeoutError(f"{what}: the upstream did not answer in time")
    else:
        error = errors.UpstreamError(f"{what}: the connection to the upstream failed")
    if isinstance(exc, connection.PoolTimeout):
        error.detail = f"backend {backend!r}: every connection is busy (pool.max_connections reached): {exc}"
    else:
        error.detail = f"backend {backend!r}: {type(exc).__name__}: {exc}"
    return error
