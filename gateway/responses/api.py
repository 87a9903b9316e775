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

The operations on a stored response run through the pipeline too (`Exchange.resource` set, no body, the
model unknown until the owner is read): auth comes first, so a request without a valid key gets the same
401 whether the id exists or not; the rate limiter charges the tenant one request; then `admit` reads the
owner and sets the model and target. The stored response's usage is not counted again.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway import errors
from gateway.context import Exchange, Target
from gateway.responses.index import Indexing, Owner, ResponseIndex, index_key, item_key
from gateway.responses.jobs import Background, Canned
from gateway.server import request
from gateway.server.reply import send_error
from gateway.state.store import StoreUnavailable
from gateway.upstream.health import Health

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from gateway.pipeline import Pipeline
    from gateway.settings import Settings
    from gateway.state.store import Store
    from gateway.upstream.attempts import Upstreams
    from gateway.upstream.providers.base import Provider, UpstreamResponse

log = logging.getLogger("sluice.responses")

PREFIXES = ("/v1/responses/", "/responses/", "/openai/v1/responses/")
JOB_PREFIX = "/v1/sluice/background/"
OPERATIONS = {"": ("GET", "DELETE"), "cancel": ("POST",), "input_items": ("GET",)}
JOB_OPERATIONS = {"": ("GET",), "events": ("GET",)}
NATIVE_BACKGROUND = frozenset({"openai"})  # backend types that run background responses themselves
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
JOBS_ENDPOINT = "chat/completions"  # the endpoint of a chat job's operations (/v1/sluice/background/{id})
UNKNOWN_MODEL = ""  # a stored object's model until its owner is read
RETRY_AFTER = (b"retry-after", b"1")


class Owned:
    """A stored response's backend, for the tenant that created it only; a DELETE forgets it."""

    def __init__(self, inner: Provider, index: ResponseIndex, ident: str, owner: Owner) -> None:
        self.inner = inner
        self.index = index
        self.ident = ident
        self.owner = owner
        self.kind = inner.kind
        self.system = inner.system
        self.url = getattr(inner, "url", None)
        self.health = inner.health  # read by the attempt loop: a backend known down is tried last
        self.reports_usage = inner.reports_usage
        self.usage_of_first_choice = inner.usage_of_first_choice

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        if self.owner.tenant != ex.tenant:  # admitted for its owner only; this holds whatever calls it
            raise not_found(self.ident)
        response = await self.inner.send(ex, target)
        if ex.method == b"DELETE" and response.status == 200:
            await self.index.forget(self.ident)
        return response


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


class Starter(Run):
    """The one target of a background request run by the gateway: starts the job, answers at once."""

    def __init__(self, background: Background, index: ResponseIndex, chain: tuple[Target, ...], system: str) -> None:
        super().__init__(background, index, system)
        self.chain = chain

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        ident, response = await self.background.begin(ex, self.chain)
        await self.index.note_now(ident, Owner(ex.tenant, ex.model, job=True))
        return response


class Reader(Run):
    """A background job's record and events, for the tenant that created it only."""

    def __init__(self, background: Background, index: ResponseIndex, ident: str, system: str) -> None:
        super().__init__(background, index, system)
        self.ident = ident

    async def send(self, ex: Exchange, target: Target) -> UpstreamResponse:
        background = self.background
        try:
            job = await background.jobs.get(self.ident)
            if job is None or job.tenant != ex.tenant:
                raise not_found(self.ident)
            job = await background.check_owner(job)
            path, _, query = ex.resource.partition("?")
            operation = path.strip("/").partition("/")[2]
            if operation == "cancel":
                job = await background.cancel(job)
            elif operation == "input_items":
                items = orjson.loads(job.input)
                first, last = (items[0].get("id"), items[-1].get("id")) if items else (None, None)
                page = {"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": False}
                return Canned(200, orjson.dumps(page))
            elif ex.method == b"DELETE":
                await background.cancel(job)
                await background.jobs.delete(job)  # its record, input items and events: for every instance
                await self.index.forget(self.ident)
                return Canned(200, orjson.dumps({"id": self.ident, "object": "response", "deleted": True}))
            elif operation == "events" or ex.stream:
                return background.follow(job, _after(ex, query))
        except StoreUnavailable:
            raise unavailable(jobs=True) from None
        return Canned(200, job.object)


def _after(ex: Exchange, query: str) -> int:
    """The sequence number to resume after: `starting_after` (Responses) or `Last-Event-ID` (SSE)."""
    given = ex.header(b"last-event-id")
    value = given.decode("latin-1") if given is not None else ""
    for pair in query.split("&"):
        name, _, found = pair.partition("=")
        if name == "starting_after":
            value = found
    value = value.strip()
    return int(value) if value.lstrip("-").isdigit() else -1


def not_found(ident: str) -> errors.GatewayError:
    # As OpenAI answers it: a 404 without a code.
    message = f"Response with id '{ident}' not found."
    return errors.GatewayError(message, status=404, type="invalid_request_error", param="response_id")


def reference_not_found(param: str, ident: str) -> errors.GatewayError:
    """Another tenant's object, or one without an owner record: the same answer, so it tells nothing."""
    what = "Previous response" if param == "previous_response_id" else "Item"
    code = "previous_response_not_found" if param == "previous_response_id" else None
    message = f"{what} with id '{ident}' not found."
    return errors.GatewayError(message, status=404, type="invalid_request_error", param=param, code=code)


def unavailable(jobs: bool) -> errors.GatewayError:
    """The owner of an object cannot be read: fail closed, never a guess (nor a forward without an owner)."""
    if jobs:
        message, code = "the background job store is unavailable; retry shortly", "background_unavailable"
    else:
        message, code = "the response store is unavailable; retry shortly", "response_store_unavailable"
    return errors.ServiceUnavailableError(message, code=code, headers=[RETRY_AFTER])


def _is_reference(item: dict[str, Any]) -> bool:
    """An input item that names a stored item by id: `type: item_reference`, or (the type being optional)
    an item with an id and neither a type nor a role."""
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "role" not in item and "id" in item)


class Responses:
    """Routing for POST /v1/responses and the handler of the stored-response paths; built at start-up."""

    def __init__(self, settings: Settings, upstreams: Upstreams, pipeline: Pipeline, store: Store | None) -> None:
        self.settings = settings
        self.upstreams = upstreams
        self.pipeline = pipeline
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

    async def handle(self, scope: Scope, receive: Receive, send: Send, rest: str, jobs: bool = False) -> None:
        """GET/DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items;
        with `jobs`, GET /v1/sluice/background/{id} and GET /v1/sluice/background/{id}/events.

        Only the path is judged here; the id is looked up by `admit`, after auth, so that a request without
        a valid key learns nothing about it."""
        started = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = request.request_id(headers)
        ident, _, operation = rest.partition("/")
        method: str = scope["method"]
        operations = JOB_OPERATIONS if jobs else OPERATIONS
        allowed = operations.get(operation)
        if allowed is None or not RESPONSE_ID.fullmatch(ident):
            await send_error(send, errors.NotFoundError("unknown URL", code="unknown_url"), rid)
            return
        if method not in allowed:
            error = errors.MethodNotAllowedError(f"{method} is not allowed here")
            error.headers = [(b"allow", ", ".join(allowed).encode())]
            await send_error(send, error, rid)
            return
        try:
            await request.read_body(receive, headers, self.max_body)  # nothing is expected, but read it off
        except request.ClientGone:
            return
        except errors.GatewayError as exc:
            await send_error(send, exc, rid)
            return
        query: bytes = scope.get("query_string", b"")
        # The model is unknown until the owner is read (admit): "" meanwhile, which no model is called.
        ex = Exchange(rid, JOBS_ENDPOINT if jobs else "responses", headers, b"", {"model": UNKNOWN_MODEL}, started)
        ex.method = method.encode()
        ex.resource = "/" + rest + ("?" + query.decode("latin-1") if query else "")
        ex.stream = operation == "events" or (method == "GET" and not operation and b"stream=true" in query)
        ex.mark("parse", started)
        await self.pipeline.serve(ex, receive, send)

    async def admit(self, ex: Exchange) -> None:
        """The pipeline's admission step, after the plugins' on_request (the tenant is known) and before any
        upstream: a stored object's operation gets its owner's target, or a 404 / 503; a create's references
        to stored objects are checked against the tenant. Timed as stage "index" when it reads the index."""
        if not ex.resource and not self._references(ex):
            return
        since = time.perf_counter()
        try:
            if ex.resource:
                await self._find(ex)
            else:
                await self._check_references(ex)
        except StoreUnavailable:
            raise unavailable(ex.endpoint == JOBS_ENDPOINT) from None
        finally:
            ex.mark("index", since)

    async def _find(self, ex: Exchange) -> None:
        jobs = ex.endpoint == JOBS_ENDPOINT
        ident = ex.resource[1:].partition("/")[0].partition("?")[0]
        owner = await self.index.lookup(ident)
        if owner is None or owner.tenant != ex.tenant:
            raise not_found(ident)
        target = self.upstreams.targets.get(owner.model)
        job = owner.job
        # Each path reads its own kind: a Responses job or stored response under /v1/responses, a chat job
        # under /v1/sluice/background.
        wrong_path = (job and ident.startswith("resp_") == jobs) or (jobs and not job)
        if target is None or (target.backend not in self.wrapped and not job) or wrong_path:
            raise not_found(ident)
        system = target.provider.system
        if job:
            provider: Any = Reader(self.background, self.index, ident, system)
        else:
            provider = Owned(self.upstreams.providers[target.backend], self.index, ident, owner)
        ex.model = target.model
        ex.targets = [_rewrap(target, provider, timed=False)]

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


def _rewrap(target: Target, provider: Any, timed: bool = True) -> Target:
    """`target` served by `provider`; `timed=False` drops the first-token deadline and hedging, which are
    about a model generating, not about reading what a job stored (a queued job has no first token yet)."""
    settings = target.settings
    if not timed:
        settings = settings.model_copy(update={"first_token_deadline_ms": None, "hedge_after_ms": None})
    return Target(target.model, target.backend, target.upstream_model, settings, provider)
