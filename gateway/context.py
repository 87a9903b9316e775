"""Exchange: the state of one proxied request as it moves through the pipeline.

Built in step 1 (parse) and read by every later step. Plugins keep their own data in `state`, keyed by
plugin name, and tell telemetry what it should know through `labels` (the metric labels they declare),
`attributes` (span attributes) and, when one refuses the request, `rejected_by`; telemetry reads only those.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

# At run time, not only for the type checker: compiled, the dataclass below reads its fields' types at import.
from gateway.settings import ModelSettings

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.upstream.providers.base import Provider

# The provider's protocol, which compiled code does not check, named at run time too (the contract imports no
# upstream module).
globals().setdefault("Provider", object)


@dataclass(frozen=True, slots=True)
class Target:
    """One place a request can be served: a public model on its backend, built once at start-up."""

    model: str  # the public name clients use
    backend: str  # the backend's name in the config
    upstream_model: str  # the name sent upstream (Azure: the deployment)
    settings: ModelSettings
    provider: Provider


class RouteBias(Protocol):
    """A plugin's weight on each endpoint for one request (`Exchange.route_bias`), and its word of the pick."""

    def __call__(self, endpoint: str) -> int:
        """The endpoint's weight (by its label): least_outstanding prefers the lower, before load."""
        ...

    def sent(self, ex: Exchange, endpoint: str) -> None:
        """`ex` is being sent to `endpoint` (again to another, when the first failed before its first byte)."""
        ...


class Exchange:
    # What most requests never change, as class attributes (no __slots__, so that they can be): only the
    # attributes a request sets are stored on it, which saves a dozen stores a request.
    method = b"POST"
    # A stored object's path below the endpoint ("/resp_1/cancel", "/resp_1?stream=true"), empty when
    # the request makes something new: it reads or changes what an earlier request made.
    resource = ""
    index: dict[bytes, bytes] | None = None  # name -> first value, made by the first header() call
    tenant = "anonymous"
    served: Target | None = None
    fallback: str | None = None  # why the first target did not serve: slo|deadline|error|hedge|loading|overload
    hedge_after_ms: float | None = None  # set by a routing plugin to race the next target
    hedged = False
    traceparent: bytes | None = None
    upstream_ms = 0.0  # time spent waiting on upstreams before the response head
    pool_ms = 0.0  # of which getting a connection for the attempt that served
    route_ms = 0.0  # of which choosing endpoints (replicas) within backends
    routed: tuple[str, str, float] | None = None  # the last endpoint chosen: (endpoint, policy, score)
    overhead_ms = 0.0  # the gateway's own time before the response head (0: no head was sent)
    server_timing: bytes | None = None  # the response head's `server-timing`, once written
    rejected_by: str | None = None  # the plugin that refused the request, if one did
    # Fields a plugin adds to the upstream body, per backend name (the admission plugin: vLLM's `priority`,
    # OpenAI's `service_tier`); None, the default, sends the client's body as it came.
    upstream_fields: Mapping[str, Mapping[str, Any]] | None = None
    # Headers for the response that a plugin knows before the answer (the rate limits, the priority class):
    # added to the head where on_response hooks add theirs, without a hook to run (add_response_headers).
    response_headers: list[tuple[bytes, bytes]] | None = None

    def __init__(
        self,
        request_id: str,
        endpoint: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        json: dict[str, Any],
        started: float,
    ) -> None:
        self.request_id = request_id
        self.endpoint = endpoint  # "chat/completions", "completions", "embeddings" or "responses"
        self.headers = headers  # as the client sent them, names lower-cased; never changed afterwards
        self.body = body  # the raw request body, forwarded as is when nothing must change
        self.json = json  # the body parsed once
        self.started = started  # perf_counter() when the request arrived
        self.model: str = json["model"]
        self.stream: bool = bool(json.get("stream", False))
        # What the client asked of a stream; upstreams are asked for usage either way (see server/relay.py).
        options = json.get("stream_options") if self.stream else None
        # A Responses stream always ends with its usage (in response.completed): nothing to ask for or hide.
        self.include_usage = endpoint == "responses" or (
            isinstance(options, dict) and options.get("include_usage") is True
        )
        self.targets: list[Target] = []
        self.attempts: list[tuple[str, float, int]] = []  # (model, ms, status; 0 = served) per upstream try
        self.timings: list[tuple[str, float]] = []  # (stage, ms), in the order the stages ran
        self.state: dict[str, Any] = {}
        self.labels: dict[str, str] = {}  # metric label -> value, for the labels plugins declare
        self.attributes: dict[str, str | int | float | bool] = {}  # extra span attributes set by plugins
        # Set by a plugin: per endpoint label, what least_outstanding weighs before load (the admission plugin: the
        # top-class requests in flight there, which an engine that preempts by priority cannot pause for this one).
        # Stored here rather than defaulted on the class: compiled, a class default of a callable protocol's type is
        # not set on the instance.
        self.route_bias: RouteBias | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case), or None.

        Several stages read headers: one dict made in C on the first read serves them all, where each scan of
        the list ran a Python loop (reversed, so that the first of repeated headers wins, as a scan finds it).
        """
        index = self.index
        if index is None:
            index = self.index = dict(reversed(self.headers))
        return index.get(name)

    def add_response_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Headers the response will carry, whatever answers (an upstream, a plugin's reply, an error after this
        point); `headers` is a list the caller gives up."""
        if self.response_headers is None:
            self.response_headers = headers
        else:
            self.response_headers += headers

    def mark(self, stage: str, since: float) -> float:
        """Record a stage that started at `since` (perf_counter) and ends now; return now."""
        now = time.perf_counter()
        self.timings.append((stage, (now - since) * 1000.0))
        return now
