"""Operations on stored objects: a stored response or a background job, read, cancelled or deleted.

The HTTP paths (`GET/DELETE /v1/responses/{id}`, `POST .../cancel`, `GET .../input_items`, and a chat job's
`GET /v1/sluice/background/{id}[/events]`) become an Exchange here with `resource` set, no body and the model
unknown; the pipeline runs the plugins' on_request on it (auth first, so that a request without a valid key
gets the same 401 whether the id exists or not; the rate limiter charges the tenant one request), then hands
it to `dispatch` instead of the attempt loop. `dispatch` reads the owner: anyone but the tenant that made the
object gets a 404, as for an id that does not exist, and so does an id without an owner record (never
forwarded anywhere); an owner that cannot be read (Redis down or slow) is a 503 with `retry-after`. A stored
response is then asked of its model's backend once (no deadline, no hedge, no other target: no other backend
holds it); a background job is answered from the job store, on any instance.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import orjson

from gateway import errors
from gateway.context import Exchange
from gateway.jobs.background import Canned
from gateway.state.store import StoreUnavailable
from gateway.upstream.attempts import Opened

if TYPE_CHECKING:
    from gateway.jobs.background import Background
    from gateway.jobs.store import Job
    from gateway.responses.index import ResponseIndex
    from gateway.upstream.attempts import Upstreams
    from gateway.upstream.providers.base import UpstreamResponse

OPERATIONS = {"": ("GET", "DELETE"), "cancel": ("POST",), "input_items": ("GET",)}
JOB_OPERATIONS = {"": ("GET",), "events": ("GET",)}
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
JOBS_ENDPOINT = "chat/completions"  # the endpoint of a chat job's operations (/v1/sluice/background/{id})
UNKNOWN_MODEL = ""  # a stored object's model until its owner is read
RETRY_AFTER = (b"retry-after", b"1")


def not_found(ident: str) -> errors.GatewayError:
    # As OpenAI answers it: a 404 without a code.
    message = f"Response with id '{ident}' not found."
    return errors.GatewayError(message, status=404, type="invalid_request_error", param="response_id")


def unavailable(jobs: bool) -> errors.GatewayError:
    """The owner of an object cannot be read: fail closed, never a guess (nor a forward without an owner)."""
    if jobs:
        message, code = "the background job store is unavailable; retry shortly", "background_unavailable"
    else:
        message, code = "the response store is unavailable; retry shortly", "response_store_unavailable"
    return errors.ServiceUnavailableError(message, code=code, headers=[RETRY_AFTER])


def exchange(
    headers: list[tuple[bytes, bytes]], method: str, rest: str, query: bytes, jobs: bool, started: float, rid: str
) -> Exchange:
    """The Exchange of an operation on a stored object, or the 404 / 405 of a path that names none.

    Only the path is judged here; the id is looked up by `dispatch`, after auth, so that a request without a
    valid key learns nothing about it."""
    ident, _, operation = rest.partition("/")
    allowed = (JOB_OPERATIONS if jobs else OPERATIONS).get(operation)
    if allowed is None or not RESPONSE_ID.fullmatch(ident):
        raise errors.NotFoundError("unknown URL", code="unknown_url")
    if method not in allowed:
        error = errors.MethodNotAllowedError(f"{method} is not allowed here")
        error.headers = [(b"allow", ", ".join(allowed).encode())]
        raise error
    ex = Exchange(rid, JOBS_ENDPOINT if jobs else "responses", headers, b"", {"model": UNKNOWN_MODEL}, started)
    ex.method = method.encode()
    ex.resource = "/" + rest + ("?" + query.decode("latin-1") if query else "")
    ex.stream = operation == "events" or (method == "GET" and not operation and b"stream=true" in query)
    ex.mark("parse", started)
    return ex


class Stored:
    """The pipeline's `dispatch`: an operation on a stored object, for its owner only."""

    def __init__(
        self, upstreams: Upstreams, index: ResponseIndex, background: Background, capable: frozenset[str]
    ) -> None:
        self.upstreams = upstreams
        self.index = index
        self.background = background
        self.capable = capable  # backends with the Responses API: the only ones a stored response can be on

    async def dispatch(self, ex: Exchange) -> Opened:
        jobs = ex.endpoint == JOBS_ENDPOINT
        ident = ex.resource[1:].partition("/")[0].partition("?")[0]
        since = time.perf_counter()
        try:
            owner = await self.index.lookup(ident)
            if owner is None or owner.tenant != ex.tenant:
                raise not_found(ident)
            target = self.upstreams.targets.get(owner.model)
            # Each path reads its own kind: a Responses job or stored response under /v1/responses, a chat job
            # under /v1/sluice/background.
            wrong_path = (owner.job and ident.startswith("resp_") == jobs) or (jobs and not owner.job)
            if target is None or (target.backend not in self.capable and not owner.job) or wrong_path:
                raise not_found(ident)
            ex.model = target.model
            if owner.job:
                job = await self.background.jobs.get(ident)
                if job is None or job.tenant != ex.tenant:
                    raise not_found(ident)
                ex.targets = [target]
                ex.served = target
                return await self._job(ex, await self.background.check_owner(job), ident)
        except StoreUnavailable:
            ex.rejected_by = "responses"
            raise unavailable(jobs) from None
        except errors.GatewayError:
            ex.rejected_by = "responses"
            raise
        finally:
            ex.mark("index", since)
        opened = await self.upstreams.once(ex, target)
        if ex.method == b"DELETE" and opened.response.status == 200:
            await self.index.forget(ident)
        return opened

    async def _job(self, ex: Exchange, job: Job, ident: str) -> Opened:
        """A background job's record, input items or events, from the job store."""
        background = self.background
        path, _, query = ex.resource.partition("?")
        operation = path.strip("/").partition("/")[2]
        response: UpstreamResponse
        if operation == "cancel":
            job = await background.cancel(job)
            response = Canned(200, job.object)
        elif operation == "input_items":
            items = orjson.loads(job.input)
            first, last = (items[0].get("id"), items[-1].get("id")) if items else (None, None)
            page = {"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": False}
            response = Canned(200, orjson.dumps(page))
        elif ex.method == b"DELETE":
            await background.cancel(job)
            await background.jobs.delete(job)  # its record, input items and events: for every instance
            await self.index.forget(ident)
            response = Canned(200, orjson.dumps({"id": ident, "object": "response", "deleted": True}))
        elif operation == "events" or ex.stream:
            response = background.follow(job, _after(ex, query))
            return Opened(response, await response.next_chunk())
        else:
            response = Canned(200, job.object)
        return Opened(response, await response.read())


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
