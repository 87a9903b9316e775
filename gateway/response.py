"""What a request's answer is made of on its way out: a plugin's `Reply`, the `ResponseHead` plugins may add
to, the `Outcome` known once it has ended, and the `Tap` that sees its body pass.

Apart from the plugin contract (gateway/plugin.py, which names them for plugins) because every request makes
an Outcome and a ResponseHead: here they are native classes in the compiled build (setup.py), where a
dataclass made by an interpreted module costs an interpreted `__init__` each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

Tap = Callable[[bytes], None]


@dataclass(slots=True)
class Reply:
    """An answer made by a plugin instead of an upstream: a whole body, or a stream of body pieces."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    source: str = ""  # the plugin that answered
    # The tokens upstreams spent on this answer, when a plugin called them for it (the cascade): the request's
    # usage, as an upstream answer's would be. None: nothing was generated for it (a cache hit).
    usage: dict[str, Any] | None = None


# The two a request makes have their __init__ written out: compiled, a dataclass's own is interpreted.
@dataclass(slots=True, init=False)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]  # what the client will get; plugins may append

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers


@dataclass(slots=True, init=False)
class Outcome:
    """What happened, known once the response has ended."""

    status: int
    complete: bool  # the whole body reached the client (for streams: up to [DONE])
    error: str | None  # why it did not, when it did not
    client_gone: bool
    ttft_ms: float | None  # streams: to the first chunk carrying content
    tpot_ms: float | None  # streams: mean time per output token after the first
    total_ms: float
    chunks: int
    usage: dict[str, Any] | None
    usage_source: str  # "estimated": counted from a stream's events, the upstream sent none
    source: str  # "upstream" or the plugin that answered

    def __init__(
        self,
        status: int,
        complete: bool = False,
        error: str | None = None,
        client_gone: bool = False,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        total_ms: float = 0.0,
        chunks: int = 0,
        usage: dict[str, Any] | None = None,
        usage_source: str = "upstream",
        source: str = "upstream",
    ) -> None:
        self.status = status
        self.complete = complete
        self.error = error
        self.client_gone = client_gone
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.total_ms = total_ms
        self.chunks = chunks
        self.usage = usage
        self.usage_source = usage_source
        self.source = source
