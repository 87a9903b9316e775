"""Backends and the attempt loop: try `ex.targets` in order until one answers with a first chunk.

Before anything has gone to the client a target may still be abandoned for the next one: a transport
failure, a 429 or a 5xx, or no first chunk within the model's `first_token_deadline_ms`. A 4xx other than
429 is the client's problem and is answered as is. Once `open()` returns, the response is committed:
what happens after is the relay's business (streaming.py), never a retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import errors
from gateway.context import Target
from gateway.pool import PoolError
from gateway.providers.azure import AzureProvider
from gateway.providers.openai import OpenAIProvider
from gateway.providers.simulated import SimulatedProvider
from gateway.providers.vllm import VLLMProvider
from gateway.simulation import Profile

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.providers.base import Provider, UpstreamResponse
    from gateway.settings import Settings

log = logging.getLogger("sluice.upstream")

RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
ERROR_BODY_LIMIT = 64 * 1024
# An upstream's advice the client's SDK acts on (its retry back-off), kept when its error is passed on.
PASSED_ON_ERROR = frozenset({b"retry-after", b"retry-after-ms", b"x-should-retry"})


@dataclass(slots=True)
class Opened:
    """A committed upstream answer: its head, and the first body chunk already read."""

    response: UpstreamResponse
    first: bytes


def build_provider(name: str, settings: Settings) -> Provider:
    backend = settings.backends[name]
    if backend.type == "simulated":
        return SimulatedProvider(Profile(ttft_ms=backend.ttft_ms, tpot_ms=backend.tpot_ms, tokens=backend.tokens))
    if backend.type == "azure":
        return AzureProvider(name, backend, settings.pool)
    if backend.type == "vllm":
        return VLLMProvider(name, backend, settings.pool)
    return OpenAIProvider(name, backend, settings.pool)


class Upstreams:
    """Every backend's provider and every public model's targets, built once at start-up."""

    def __init__(self, settings: Settings) -> None:
        self.providers: dict[str, Provider] = {name: build_provider(name, settings) for name in settings.backends}
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

    def _chain(self, model: str) -> tuple[Target, ...]:
        order: list[str] = []
        pending = [model]
        while pending:
            name = pending.pop(0)
            if name not in order:
                order.append(name)
                pending.extend(self.targets[name].settings.fallback)
        return tuple(self.targets[name] for name in order)

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in self.providers.values()))

    @property
    def ready(self) -> bool:
        return all(p.ready for p in self.providers.values())

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in self.providers.values()), return_exceptions=True)

    async def open(self, ex: Exchange) -> Opened:
        """The first target that answers; raises the last target's error when none does."""
        targets = ex.targets
        last = len(targets) - 1
        failure: errors.GatewayError | None = None
        for index, target in enumerate(targets):
            started = time.perf_counter()
            try:
                opened = await self._attempt(ex, target)
            except errors.GatewayError as exc:
                if index == last or not _retryable(exc):
                    raise
                failure = exc
                log.info(
                    "model %s on %s failed (%s); trying %s",
                    target.model,
                    target.backend,
                    exc.status,
                    targets[index + 1].model,
                )
                continue
            finally:
                ex.upstream_ms += (time.perf_counter() - started) * 1000.0
            ex.served = target
            if index > 0 and ex.fallback is None:
                ex.fallback = "deadline" if isinstance(failure, errors.UpstreamTimeoutError) else "error"
            return opened
        raise failure or errors.NotFoundError(f"no target for model {ex.model!r}")  # pragma: no cover

    async def _attempt(self, ex: Exchange, target: Target) -> Opened:
        deadline = target.settings.first_token_deadline_ms if ex.stream else None
        try:
            if deadline is None:
                return await self._first(ex, target)
            return await asyncio.wait_for(self._first(ex, target), deadline / 1000.0)
        except TimeoutError:
            raise errors.UpstreamTimeoutError(
                f"model {target.model!r}: no first token within {deadline:g} ms", code="first_token_deadline"
            ) from None
        except PoolError as exc:
            raise errors.from_pool_error(exc, target.backend) from None

    async def _first(self, ex: Exchange, target: Target) -> Opened:
        response = await target.provider.send(ex, target)
        try:
            if response.status >= 400:
                body = await _read_bounded(response)
                error = errors.from_upstream(response.status, body, target.backend)
                error.headers = [(k, v) for k, v in response.headers if k in PASSED_ON_ERROR]
                raise error
            # A stream commits at its first chunk; a whole answer is read before anything is sent, so that a
            # body cut short is still a clean 502 rather than a truncated 200.
            first = await response.next_chunk() if ex.stream else await response.read()
        except BaseException:
            response.close()  # cancelled by the deadline, or failed: the upstream request ends here
            raise
        return Opened(response, first)


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
