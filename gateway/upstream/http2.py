"""HTTP/2 upstreams (`pool: {http2: true}`), through httpx, behind the same interface as our HTTP/1.1 pool.

HTTP/2 multiplexes every request to a backend over one or a few TLS connections, which suits a gateway
far from its upstream (one handshake, no head-of-line blocking between requests). httpx's h2 support is
well kept; its per-request cost (~0.5 ms of CPU) is why HTTP/1.1, our own pool, stays the default. Errors
are mapped to the pool's, so the attempt loop and the relay treat both transports alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator

import httpx

from gateway.upstream import connection
from gateway.upstream.pool import PoolLimits


@contextlib.contextmanager
def mapped() -> Iterator[None]:
    """httpx's exceptions as the pool's."""
    try:
        yield
    except httpx.ConnectTimeout as exc:
        raise connection.ConnectTimeout(str(exc) or "connect timed out") from exc
    except httpx.ConnectError as exc:
        raise connection.ConnectError(str(exc) or "cannot connect") from exc
    except httpx.PoolTimeout as exc:
        raise connection.PoolTimeout(str(exc) or "no connection free") from exc
    except httpx.TimeoutException as exc:
        raise connection.ReadTimeout(str(exc) or "upstream idle for too long") from exc
    except httpx.HTTPError as exc:
        raise connection.RemoteProtocolError(str(exc) or type(exc).__name__) from exc


class Http2Response:
    """An httpx streaming response as an UpstreamResponse."""

    __slots__ = ("_body", "_response", "acquire_ms", "complete", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._body: AsyncIterator[bytes] = response.aiter_raw()
        self.status = response.status_code
        self.headers = [(name.lower(), value) for name, value in response.headers.raw]
        self.complete = False
        self.acquire_ms = 0.0  # httpx does not tell: multiplexed streams rarely wait

    async def next_chunk(self) -> bytes:
        with mapped():
            async for chunk in self._body:
                if chunk:
                    return chunk
        self.complete = True
        return b""

    async def read(self) -> bytes:
        return await connection.read_all(self.next_chunk)

    def close(self) -> None:
        if not self.complete and not self._response.is_closed:
            # Resetting the stream needs the loop; the connection itself stays up for the others.
            asyncio.get_running_loop().create_task(self._response.aclose())


class Http2Client:
    """One backend's httpx client, with the pool's limits and timeouts."""

    def __init__(self, url: str, limits: PoolLimits, tls: ssl.SSLContext | None) -> None:
        self.url = url
        self.client = httpx.AsyncClient(
            http2=True,
            verify=tls if tls is not None else True,
            limits=httpx.Limits(
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_idle,
                keepalive_expiry=limits.keepalive_expiry,
            ),
            timeout=httpx.Timeout(
                connect=limits.connect_timeout,
                read=max(limits.first_byte_timeout, limits.idle_read_timeout),
                write=limits.connect_timeout,
                pool=limits.pool_timeout,
            ),
        )
        self.origin = url.split("/", 3)[:3]

    async def warm(self) -> int:
        """Open the connection (TCP, TLS, HTTP/2 settings) with one cheap request; its answer does not matter."""
        with mapped():
            await self.client.get(f"{self.url}/models")
        return 1

    async def request(self, method: bytes, target: bytes, headers: bytes, body: bytes) -> Http2Response:
        fields = []
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b": ")
            if name:
                fields.append((name, value))
        request = self.client.build_request(
            method.decode(), "/".join(self.origin) + target.decode(), headers=fields, content=body
        )
        with mapped():
            response = await self.client.send(request, stream=True)
        return Http2Response(response)

    async def aclose(self) -> None:
        await self.client.aclose()
