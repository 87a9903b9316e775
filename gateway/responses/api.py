"""The Responses API: `POST /v1/responses` through the pipeline, and the operations on a stored response.

Creating a response is an ordinary request (endpoint "responses"): auth, rate limits, cache, SLO fallback
and telemetry apply as for chat completions. Three things differ, all decided here:

- Targets: only backends with the Responses API serve it (`responses_api`, true by default for every kind).
  A fallback on a chat-only backend is dropped from the chain, and a model whose every target is chat-only
  is refused with a 400: a Responses request is never translated to chat completions behind the client's
  back (its stored state, tools and event stream have no faithful equivalent there).
- Ownership: the id of every response the gateway sees created is remembered with its tenant and model
  (`ResponseIndex`, in Redis when configured, else in process). `GET/DELETE /v1/responses/{id}`,
  `POST .../cancel` and `GET .../input_items` go to that model's backend, and only for that tenant: anyone
  else gets a 404, as for an id that does not exist, and so does an id without an owner record (never
  forwarded anywhere). An owner that cannot be read (Redis down or slow) is a 503 with `retry-after`.
- References: `previous_response_id`, `conversation` and `item_reference` input items of a create are
  checked against the caller's tenant the same way (`admit`, after auth and before any upstream).

The operations on a stored response or a background job (read, cancel, delete) are dispatched by the pipeline
after auth and the rate limiter, without the attempt loop (stored.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from gateway import errors
from gateway.context import Exchange, Target
from gateway.jobs.background import Background
from gateway.responses.index import Indexing, Owner, ResponseIndex, index_key, item_key
from gateway.responses.stored import RESPONSE_ID, RETRY_AFTER, Stored, unavailable
from gateway.state.store import StoreUnavailable
from gateway.upstream.health import Health

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from gateway.settings import Settings
    from gateway.state.store import Store
    from gateway.upstream.attempts import Upstreams
    from gateway.upstream.providers.base import Provider, UpstreamResponse

log = logging.getLogger("sluice.responses")

PREFIXES = ("/v1/responses/", "/responses/", "/openai/v1/responses/")
JOB_PREFIX = "/v1/sluice/background/"
NATIVE_BACKGROUND = frozenset({"openai"})  # backend types that run background responses themselves


class Run:
    """A target that is the gateway itself running background jobs: never down, no address."""

    kind = "background"
    reports_usage = True
    usage_of_first_choice = False

    def __init__(self, background: Background, index: ResponseIndex, system: str) -> None:
        self.background = background
        self.index = index
        self.system = system
        self.url = None
        self.health = Health("background")
        self.ready = True

    async def start(self) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return self.health.report()

    def instrument(self, gauge: Gauge) -> None:
        return None  # no endpoints: the jobs run in this process

    def in_service(self) -> int:
        return 1

    def endpoint_urls(self) -> list[str]:
        return []

    async def aclose(self) -> None:
        return None  # the jobs are Background's to end


class Starter(Run):
    """The one target of a background request run by the gateway: starts the job, answers at once."""

    def __init__(self, background: Background, index: ResponseIndex, chain: tuple[Target, ...], system: str) -> None:
        super().__init__(background, index, system)
        self.chain = chain

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        ident, response = await self.background.begin(ex, self.chain)
        await self.index.note_now(ident, Owner(ex.tenant, ex.model, job=True))
        return response


def reference_not_found(param: str, ident: str) -> errors.GatewayError:
    """Another tenant's object, or one without an owner record: the same answer, so it tells nothing."""
    what = "Previous response" if param == "previous_response_id" else "Item"
    code = "previous_response_not_found" if param == "previous_response_id" else None
    message = f"{what} with id '{ident}' not found."
    return errors.GatewayError(message, status=404, type="invalid_request_error", param=param, code=code)


def _is_reference(item: dict[str, Any]) -> bool:
    """An input item that names a stored item by id: `type: item_reference`, or (the type being optional)
    an item with an id and neither a type nor a role."""
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "role" not in item and "id" in item)


class Responses:
    """Routing for POST /v1/responses and the handler of the stored-response paths; built at start-up."""

    def __init__(self, settings: Settings, upstreams: Upstreams, store: Store | None) -> None:
        self.settings = settings
        self.upstreams = upstreams
        self.index = ResponseIndex(store, settings.responses.index_ttl_s)
        self.max_body = settings.limits.max_body_bytes
        capable = {name for name, backend in settings.backends.items() if backend.responses_api}
        self.wrapped = {name: Indexing(upstreams.providers[name], self.index) for name in capable}
        # Each model's chain for the Responses API, once: the capable targets, seen through Indexing.
        self.chains: dict[str, tuple[Target, ...]] = {}
        self.refusals: dict[str, errors.GatewayError] = {}
        for model, chain in upstreams.chains.items():
            kept = tuple(_rewrap(t, self.wrapped[t.backend]) for t in chain if t.backend in capable)
            if kept:
                self.chains[model] = kept
                dropped = [t.model for t in chain if t.backend not in capable]
                if dropped:
                    log.info("model %s: fallback(s) %s not used for the Responses API", model, ", ".join(dropped))
            else:
                backend = chain[0].backend
                self.refusals[model] = errors.BadRequestError(
                    f"model {model!r} is served by backend {backend!r}, which has no Responses API "
                    "(responses_api: false); use /v1/chat/completions for it",
                    param="model",
                    code="responses_unsupported",
                )
        if settings.responses.default_model is not None:
            log.warning(
                "responses.default_model is ignored: a response id without an owner record is answered with a 404"
            )
        # Background mode: passed through to backends that have it, else run here (jobs.py).
        self.background = Background(settings, upstreams, store)
        # Reads, cancels and deletes of what was stored: the pipeline's `dispatch` (stored.py).
        self.stored = Stored(upstreams, self.index, self.background, frozenset(capable))
        native = {name for name, backend in settings.backends.items() if backend.type in NATIVE_BACKGROUND}
        self.starters: dict[tuple[str, str], Target] = {}
        for model, chain in upstreams.chains.items():
            primary = chain[0]
            system = primary.provider.system
            if model in self.chains and primary.backend not in native:
                capable_chain = tuple(t for t in chain if t.backend in capable)
                starter = Starter(self.background, self.index, capable_chain, system)
                self.starters[("responses", model)] = _rewrap(primary, starter, timed=False)
            self.starters[("chat/completions", model)] = _rewrap(
                primary, Starter(self.background, self.index, chain, system), timed=False
            )

    def route(self, ex: Exchange) -> None:
        """The pipeline's routing step: Responses requests get the Responses chain of their model."""
        if ex.endpoint == "chat/completions":
            if ex.header(b"x-sluice-background") == b"true":
                ex.targets = [self.starters[("chat/completions", ex.model)]]
                ex.stream = False  # the answer is the job's id; the job itself streams
                ex.json["background"] = True  # what the other stages read (the cache does not answer it)
            return
        if ex.endpoint != "responses":
            return
        refusal = self.refusals.get(ex.model)
        if refusal is not None:
            raise refusal
        background = ex.json.get("background") is True
        if background and ex.json.get("store") is False:
            raise errors.BadRequestError("a background response must be stored: drop store: false", param="store")
        starter = self.starters.get(("responses", ex.model)) if background else None
        ex.targets = [starter] if starter is not None else list(self.chains[ex.model])

    async def admit(self, ex: Exchange) -> None:
        """The pipeline's admission step for a create, after the plugins' on_request (the tenant is known) and
        before any upstream: its references to stored objects are checked against the tenant. Timed as stage
        "index" when it reads the index."""
        if not self._references(ex):
            return
        since = time.perf_counter()
        try:
            await self._check_references(ex)
        except StoreUnavailable:
            raise unavailable(jobs=False) from None
        finally:
            ex.mark("index", since)

    def _references(self, ex: Exchange) -> bool:
        """Whether a create has anything to check: a reference to a stored object, or a store to keep it in
        that is full. One dict lookup each for most requests, which have neither."""
        body = ex.json
        if body.get("store") is not False and self.index.full:
            # Its owner could not even be kept until Redis takes it: refuse it before it is made upstream.
            raise errors.ServiceUnavailableError(
                "the response store is unavailable, so a stored response cannot be made now; retry shortly, "
                "or send store: false",
                code="response_store_unavailable",
                headers=[RETRY_AFTER],
            )
        conversation = body.get("conversation")
        if conversation is not None:
            given = conversation.get("id") if isinstance(conversation, dict) else conversation
            # The gateway serves no Conversations API, so no conversation has an owner here: none is usable.
            message = f"Conversation with id '{given}' not found."
            raise errors.GatewayError(message, status=404, type="invalid_request_error", param="conversation")
        if body.get("previous_response_id") is not None:
            return True
        given = body.get("input")
        return isinstance(given, list) and any(isinstance(item, dict) and _is_reference(item) for item in given)

    async def _check_references(self, ex: Exchange) -> None:
        body = ex.json
        keys: list[str] = []
        named: list[tuple[str, str]] = []  # (what, id) for each key, for the 404
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise errors.BadRequestError("'previous_response_id' must be a string", param="previous_response_id")
            if not RESPONSE_ID.fullmatch(previous):
                raise reference_not_found("previous_response_id", previous)  # not an id: nobody's
            keys.append(index_key(previous))
            named.append(("previous_response_id", previous))
        given = body.get("input")
        if isinstance(given, list):
            for item in given:
                if isinstance(item, dict) and _is_reference(item):
                    ref = item.get("id")
                    if not isinstance(ref, str):
                        raise errors.BadRequestError("an item_reference needs a string 'id'", param="input")
                    if not RESPONSE_ID.fullmatch(ref):
                        raise reference_not_found("input", ref)
                    keys.append(item_key(ref))
                    named.append(("input", ref))
        for owner, (param, ident) in zip(await self.index.owners(keys), named, strict=True):
            if owner is None or owner.tenant != ex.tenant:
                raise reference_not_found(param, ident)

    async def start(self) -> None:
        await self.index.start()
        await self.background.start()

    async def aclose(self) -> None:
        await self.background.aclose()
        await self.index.aclose()


def _rewrap(target: Target, provider: Provider, timed: bool = True) -> Target:
    """`target` served by `provider`; `timed=False` drops the first-token deadline and hedging, which are
    about a model generating, not about reading what a job stored (a queued job has no first token yet)."""
    settings = target.settings
    if not timed:
        settings = settings.model_copy(update={"first_token_deadline_ms": None, "hedge_after_ms": None})
    return Target(target.model, target.backend, target.upstream_model, settings, provider)
