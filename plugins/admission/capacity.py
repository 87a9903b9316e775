"""The engines' own capacity, read off the request path (`capacity: auto`).

Per endpoint in service of a backend with `capacity: auto`, every `poll_s`, one small GET:

- llama.cpp (`type: llamacpp`): `/slots`, the list of its slots (`-np`); its capacity is their number. A
  server started with `--no-slots` answers 501: it cannot be read.
- vLLM (`type: vllm`): `/metrics`, `vllm:num_requests_running` and `vllm:num_requests_waiting`. vLLM does not
  publish its batch limit (`--max-num-seqs`, or fewer when the KV cache is short), but it shows it: while
  requests wait in the engine, what runs is all it can run. The running count read while some wait becomes the
  endpoint's capacity, until a later such read says otherwise; until the engine has been seen full, the
  configured `max_in_flight`.

An endpoint that cannot be read (refused, an error status, a body that does not parse, no answer within
`min(poll_s, 2 s)`) counts as `max_in_flight`, and what was learned of it is forgotten, since a restarted engine
may run with other flags; it is read again at the next poll, so a restarted engine's capacity is back within
one `poll_s` of its answering. The gate's capacity is the sum over the endpoints; the request path reads the
gate's numbers only, never waits on a read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from gateway.upstream.replica import parse_load

if TYPE_CHECKING:
    import httpx

    from gateway.upstream.providers.base import Provider
    from plugins.admission.queue import Gate

log = logging.getLogger("sluice.admission")

READABLE = frozenset({"vllm", "llamacpp"})  # the backend types whose engines say their capacity


def origin(url: str) -> str:
    """scheme://host:port of an endpoint's base URL: both engines serve these paths at the root, not under /v1."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


class Reader:
    """One backend's engines, read every `interval` seconds; the gate resized to what they say."""

    def __init__(self, gate: Gate, kind: str, provider: Provider, fallback: int, interval: float) -> None:
        self.gate = gate
        self.kind = kind
        self.provider = provider  # its endpoint_urls(): the base URLs of the endpoints in service
        self.fallback = fallback
        self.interval = interval
        self.learned: dict[str, int] = {}  # origin -> the capacity read (or, for vLLM, seen) there
        self.unread: set[str] = set()  # origins the last poll could not read, logged once each time
        self.task: asyncio.Task[None] | None = None
        self.gauge: Any = None  # sluice_admission_capacity{backend}, set after each poll

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        import httpx  # off the request path

        async with httpx.AsyncClient(timeout=min(self.interval, 2.0)) as client:
            while True:
                await self.poll(client)
                await asyncio.sleep(self.interval)

    async def poll(self, client: httpx.AsyncClient) -> None:
        origins = [origin(url) for url in self.provider.endpoint_urls()]
        reads = await asyncio.gather(*(self.read(client, o) for o in origins))
        total = 0
        for where, value in zip(origins, reads, strict=True):
            if value is None:
                self.learned.pop(where, None)
                if where not in self.unread:
                    log.warning("admission: cannot read %s's capacity; counting %d", where, self.fallback)
                    self.unread.add(where)
                total += self.fallback
            else:
                self.unread.discard(where)
                total += value
        self.gate.resize(total if origins else None)
        if self.gauge is not None:
            self.gauge.set(self.gate.capacity)

    async def read(self, client: httpx.AsyncClient, where: str) -> int | None:
        """The endpoint's capacity; None when it cannot be read."""
        import httpx

        path = "/slots" if self.kind == "llamacpp" else "/metrics"
        try:
            response = await client.get(where + path)
        except (httpx.HTTPError, OSError):
            return None
        if response.status_code != 200:
            return None
        if self.kind == "llamacpp":
            try:
                slots = response.json()
            except ValueError:
                return None
            return len(slots) if isinstance(slots, list) and slots else None
        load = parse_load(response.text)
        if load is None:
            return None
        waiting, running, _ = load
        if waiting > 0 and running >= 1:
            self.learned[where] = int(running)  # full: what runs is what it can run
        return self.learned.get(where, self.fallback)
