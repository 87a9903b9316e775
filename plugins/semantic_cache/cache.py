"""semantic_cache: answer a paraphrase of an earlier question from that question's answer, within a deadline.

It runs after `auth` (entries are per tenant) and after `cache`, whose exact hit always wins: a request that
reaches it missed the exact cache. For an eligible request (plugins/semantic_cache/key.py: chat completions,
completions or the Responses API, n = 1, the temperature bound, no tools unless allowed, a user's text last)
it:

1. embeds the text through a model of the gateway's own config (plugins/semantic_cache/embedder.py),
2. searches the store within the exact partition (tenant, model, hash of everything but the text),
3. takes the most similar entry at or above `threshold` that the guards (plugins/semantic_cache/guards.py) do
   not veto, and replays its answer: JSON, or SSE for a streaming client, marked `x-sluice-cache: semantic`,
   with `x-sluice-semantic-similarity`, the span attributes `sluice.semantic_cache.*` and the stage
   `semantic_cache` in server-timing,
4. or, when the model has a `verifier`, first asks that chat model (plugins/semantic_cache/verifier.py)
   whether the two requests need the same answer: only a clear "yes" within its `deadline_ms` keeps the hit;
   a "no", an error or the deadline is a miss counted as `verifier`; the verdict and its time are span
   attributes and access-log fields.

**Latency first.** Steps 1 and 2 run as one task that the request waits for at most `lookup_deadline_ms`;
past it the request goes upstream at once and the miss is counted as `timeout`. The task is not cancelled:
its vector is still used to store the answer when it comes back within `embed_timeout_ms` (so a slow embedder
still fills the cache without a second embedding call). At most `max_pending` such tasks run at once; beyond
them a request skips the lookup (a dead embedder then costs nothing at all).

**What is stored:** only complete 200 answers from an upstream, assembled from the stream when the client
streamed (the exact cache's assembly, gateway/wire/completion.py), never errors, cut streams or replays.

**Reports:** `x-sluice-semantic` says what the lookup found (hit, miss, near, guard, verifier, timeout, error,
bypass, skip); the request-series label `semantic_cache` is hit, miss or bypass; the counter
`sluice_semantic_cache_results_total{tenant, model, result}` has every result, and
`sluice_semantic_cache_vetoes_total{tenant, model, kind}` what the guards vetoed. A hit's entry, age and
similarity are span attributes and access-log fields.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from gateway.plugin import Problem, Reply, Schema, Tap
from gateway.wire import completion
from plugins.semantic_cache import guards
from plugins.semantic_cache.config import Config, Policy, SemanticModel, SemanticSection, policies
from plugins.semantic_cache.key import Lookup, plan
from plugins.semantic_cache.store import Entry, StoreDown, Where, make

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.plugin import Outcome, ResponseHead
    from gateway.runtime import Runtime
    from gateway.settings import Settings
    from plugins.semantic_cache.embedder import Embedder
    from plugins.semantic_cache.spelling import Speller
    from plugins.semantic_cache.store import Candidate, Store, Vector
    from plugins.semantic_cache.verifier import Verifier

log = logging.getLogger("sluice.semantic_cache")

NAME = "semantic_cache"
RESULT = "semantic_cache.result"  # ex.state key of what the lookup found (a Served)
JSON_TYPE = (b"content-type", b"application/json")
SSE_TYPE = (b"content-type", b"text/event-stream")
CACHE_HEADER = b"x-sluice-cache"
RESULT_HEADER = b"x-sluice-semantic"
SIMILARITY_HEADER = b"x-sluice-semantic-similarity"
# What the lookup found -> the request-series label (few values: it multiplies every request series).
LABELS = {"hit": "hit", "bypass": "bypass", "skip": "bypass"}


@dataclass(slots=True)
class Pending:
    """ex.state["semantic_cache"] of a request that goes upstream: what storing its answer needs."""

    policy: Policy
    lookup: Lookup
    task: asyncio.Task[Vector] | None  # the embedding, possibly still running
    chunks: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Served:
    """ex.state["semantic_cache"] of a request answered from an entry (or of a miss, for its headers)."""

    result: str
    similarity: float | None = None


class SemanticCache:
    name: ClassVar[str] = NAME
    schema: ClassVar[Schema] = Schema(
        section=SemanticSection, model=SemanticModel, after=("auth", "cache"), labels={NAME: "none"}
    )

    def __init__(self, config: Config, settings: Settings) -> None:
        base = self.settings = config.section
        self.policies = policies(config)
        # The store modules import numpy (and asyncpg): made here, so that a gateway that does not list this
        # plugin (whose schema the config loader still reads) imports neither.
        self.store: Store = make(base.store)
        self.speller: Speller | None = None
        if base.spelling and self.policies:
            from plugins.semantic_cache import spelling

            self.speller = spelling.Speller()  # its dictionary loads here, not on a request
        self.embedders: dict[str, Embedder] = {}
        self.verifiers: dict[str, Verifier] = {}  # by the cached model whose candidate hits they confirm
        self.pending = 0  # lookups still running past their request's deadline
        self.results: Any = None
        self.vetoes: Any = None
        self.stored: Any = None
        self.tenant_label: Any = str
        self._counted: dict[tuple[str, ...], Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    def check(cls, config: Config, settings: Settings, _listed: Sequence[str]) -> Iterable[Problem]:
        section = config.section
        if section.spelling and importlib.util.find_spec("spellchecker") is None:
            yield "semantic_cache.spelling", "needs pyspellchecker: pip install -e '.[semantic]' (or spelling: false)"
        if section.store.type == "pgvector" and not section.store.dsn:
            yield "semantic_cache.store.dsn", "the pgvector store needs a dsn (postgresql://...)"
        for model, spec in config.models.items():
            name = spec.semantic_cache.embedding_model
            if name is not None and name not in settings.models:
                yield f"models.{model}.semantic_cache.embedding_model", f"no model named {name!r} in models"
            verifier = spec.semantic_cache.verifier
            if verifier is not None and verifier.model not in settings.models:
                yield f"models.{model}.semantic_cache.verifier.model", f"no model named {verifier.model!r} in models"
        enabled = [
            spec.semantic_cache
            for spec in config.models.values()
            if (section.enabled if spec.semantic_cache.enabled is None else spec.semantic_cache.enabled)
        ]
        if not section.embedding_model and any(own.embedding_model is None for own in enabled):
            yield "semantic_cache.embedding_model", "required: a model of this config that serves /v1/embeddings"
        elif section.embedding_model and section.embedding_model not in settings.models:
            yield "semantic_cache.embedding_model", f"no model named {section.embedding_model!r} in models"

    @classmethod
    def purge(cls, config: Config, _settings: Settings, tenant: str, model: str | None) -> tuple[int, str]:
        """`sluice cache purge`: a tenant's entries out of the shared store (the in-process one is each gateway's)."""
        store = config.section.store
        if store.type == "memory":
            return 0, "entries are in each gateway's memory (store: memory) and expire with semantic_cache.ttl_s"
        from plugins.semantic_cache.pgvector import purge

        return asyncio.run(purge(store.dsn, store.table, tenant, model, store.timeout_s)), ""

    async def startup(self, runtime: Runtime) -> None:
        from plugins.semantic_cache.embedder import Embedder
        from plugins.semantic_cache.verifier import Verifier

        for model, policy in self.policies.items():
            name = policy.rules.embedding_model
            if name not in self.embedders:
                self.embedders[name] = Embedder(runtime.upstreams, name)
            if policy.verifier is not None:
                spec = policy.verifier
                self.verifiers[model] = Verifier(runtime.upstreams, spec.model, spec.deadline_ms / 1000.0)
        self.tenant_label = runtime.meter.tenant
        self.results = runtime.meter.counter(
            "sluice_semantic_cache_results_total",
            "Semantic cache lookups by result (hit, miss, near, guard, verifier, timeout, error, bypass, skip).",
            ("tenant", "model", "result"),
        )
        self.vetoes = runtime.meter.counter(
            "sluice_semantic_cache_vetoes_total",
            "Matches at or above the threshold vetoed by a guard, by the kind of difference.",
            ("tenant", "model", "kind"),
        )
        self.stored = runtime.meter.counter(
            "sluice_semantic_cache_stored_total",
            "Answers stored as semantic cache entries (complete 200s with their embedding).",
            ("tenant", "model"),
        )
        await self.store.start()

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.store.close()

    # -- on_request: embed, search, guard, replay

    async def on_request(self, ex: Exchange) -> Reply | None:
        policy = self.policies.get(ex.model)
        if policy is None:
            return None
        control = ex.header(b"cache-control") or b""
        lookup = plan(ex, policy.rules) if b"no-store" not in control else "no-store"
        if isinstance(lookup, str):
            self._result(ex, Served("bypass"))
            return None
        if b"no-cache" in control or self.pending >= self.settings.max_pending:
            # No lookup; with no-cache the answer is still stored (embedded after the response, off its path).
            self._result(ex, Served("skip"))
            ex.state[NAME] = Pending(policy, lookup, None)
            return None
        embedder = self.embedders[policy.rules.embedding_model]
        task = self._start(embedder, lookup.text, ex)
        pending = Pending(policy, lookup, task)
        ex.state[NAME] = pending
        try:
            async with asyncio.timeout(policy.deadline_s):
                vector = await asyncio.shield(task)
                where = Where(ex.tenant, ex.model, lookup.partition)
                try:
                    candidates = await self.store.search(where, vector, self.settings.candidates)
                except StoreDown:
                    self._result(ex, Served("error"))
                    return None
        except TimeoutError:
            self._result(ex, Served("timeout"))
            if not task.done():
                self._follow(task)
            return None
        except asyncio.CancelledError:  # the client left: the embedding runs out its own bound
            if not task.done():
                self._follow(task)
            raise
        except Exception as exc:  # the embedder failed: counted, and the request goes on upstream
            log.debug("semantic cache: embedding failed for %s: %s", ex.request_id, exc)
            self._result(ex, Served("error"))
            return None
        candidate = self._choose(ex, pending, candidates)
        if candidate is None:
            return None
        verifier = self.verifiers.get(ex.model)
        if verifier is not None:
            # Past the lookup's deadline on purpose: the verifier has its own, which its config says it may spend.
            started = time.perf_counter()
            verdict = await verifier.verdict(lookup.text, candidate.entry.text, ex)
            ex.attributes["sluice.semantic_cache.verifier"] = verdict  # in the span and the access line
            ex.attributes["sluice.semantic_cache.verifier_ms"] = round((time.perf_counter() - started) * 1000, 3)
            if verdict != "yes":
                ex.attributes["sluice.semantic_cache.similarity"] = round(candidate.similarity, 4)
                self._result(ex, Served("verifier", candidate.similarity))
                return None
        return self._replay(ex, candidate)

    def _start(self, embedder: Embedder, text: str, ex: Exchange) -> asyncio.Task[Vector]:
        if self.speller is not None:
            text = self.speller.fix(text)  # the embedding's input only: guards and the entry keep the user's text
        task = asyncio.get_running_loop().create_task(self._embed(embedder, text, ex))
        task.add_done_callback(_retrieved)  # a failure nobody awaits any more is not an unretrieved exception
        return task

    async def _embed(self, embedder: Embedder, text: str, ex: Exchange) -> Vector:
        async with asyncio.timeout(self.settings.embed_timeout_ms / 1000.0):
            return await embedder.embed(text, ex)

    def _follow(self, task: asyncio.Task[Vector]) -> None:
        """Count a lookup that outlived its deadline until it ends (it is bounded by embed_timeout_ms)."""
        self.pending += 1

        def ended(_: asyncio.Task[Vector]) -> None:
            self.pending -= 1

        task.add_done_callback(ended)

    def _choose(self, ex: Exchange, pending: Pending, candidates: list[Candidate]) -> Candidate | None:
        """The most similar candidate over the threshold that no guard vetoes; a miss is counted here."""
        policy = pending.policy
        best = candidates[0].similarity if candidates else None
        if best is None or best < policy.threshold:
            near = best is not None and best >= policy.near
            self._result(ex, Served("near" if near else "miss", best))
            return None
        query = guards.profile(pending.lookup.text) if policy.guards else None
        vetoed: list[str] = []
        for candidate in candidates:
            if candidate.similarity < policy.threshold:
                break
            if candidate.entry.endpoint != ex.endpoint:
                continue
            if query is not None:
                entry = candidate.entry
                if entry.profile is None:
                    entry.profile = guards.profile(entry.text)
                kind = guards.compare(query, entry.profile)
                if kind is not None:
                    vetoed.append(kind)
                    continue
            return candidate
        for kind in vetoed:
            self._count("vetoes", ex, kind)
        self._result(ex, Served("guard", best))
        return None

    def _replay(self, ex: Exchange, candidate: Candidate) -> Reply:
        entry = candidate.entry
        served = Served("hit", candidate.similarity)
        ex.state[NAME] = served
        self._result(ex, served)
        ex.attributes["sluice.semantic_cache.entry"] = entry.ident
        ex.attributes["sluice.semantic_cache.similarity"] = round(candidate.similarity, 4)
        ex.attributes["sluice.semantic_cache.age_s"] = round(entry.age_s, 3)
        headers = [(b"x-sluice-model", entry.served.encode())]
        if ex.stream:
            body = completion.replay(ex.endpoint, orjson.loads(entry.answer), ex.include_usage)
            return Reply(headers=[SSE_TYPE, *headers], body=body, source=NAME)
        return Reply(headers=[JSON_TYPE, *headers], body=entry.answer, source=NAME)

    def _result(self, ex: Exchange, served: Served) -> None:
        ex.state[RESULT] = served
        ex.labels[NAME] = LABELS.get(served.result, "miss")

    # -- on_response / on_complete: say what happened; store a whole answer

    async def on_response(self, ex: Exchange, head: ResponseHead) -> Tap | None:
        served = ex.state.get(RESULT)
        if not isinstance(served, Served):
            return None
        headers = head.headers
        if served.result == "hit":
            # The exact cache (before us) said `miss` of its own lookup: the answer is ours.
            headers[:] = [(k, v) for k, v in headers if k != CACHE_HEADER]
            headers.append((CACHE_HEADER, b"semantic"))
        headers.append((RESULT_HEADER, served.result.encode()))
        if served.similarity is not None:
            headers.append((SIMILARITY_HEADER, f"{served.similarity:.4f}".encode()))
        state = ex.state.get(NAME)
        if isinstance(state, Pending) and head.status == 200:
            return state.chunks.append
        return None

    async def on_complete(self, ex: Exchange, outcome: Outcome) -> None:
        served = ex.state.get(RESULT)
        if isinstance(served, Served):
            self._count("results", ex, served.result)
        state = ex.state.get(NAME)
        if not isinstance(state, Pending):
            return
        whole = outcome.complete and outcome.status == 200 and outcome.source == "upstream"
        answer = self._assemble(ex, state.chunks, outcome) if whole else None
        if answer is None:
            return
        vector = await self._vector(ex, state)
        if vector is None:
            return
        now = time.time()
        served_model = ex.served.model if ex.served is not None else ex.model
        where = Where(ex.tenant, ex.model, state.lookup.partition)
        entry = Entry(where, state.lookup.text, ex.endpoint, served_model, answer, now, now + state.policy.ttl_s)
        entry.vector = vector
        if state.policy.guards:
            entry.profile = guards.profile(entry.text)  # here, off the path of the lookups that will meet it
        try:
            await self.store.add(entry)
        except StoreDown as exc:
            log.debug("semantic cache: entry not stored: %s", exc)
            return
        self._count("stored", ex)

    async def _vector(self, ex: Exchange, state: Pending) -> Vector | None:
        task = state.task
        if task is None:
            task = self._start(self.embedders[state.policy.rules.embedding_model], state.lookup.text, ex)
        try:
            return await task
        except Exception as exc:
            log.debug("semantic cache: no embedding to store %s under: %s", ex.request_id, exc)
            return None

    def _assemble(self, ex: Exchange, chunks: list[bytes], outcome: Outcome) -> bytes | None:
        body = b"".join(chunks)
        if len(body) > self.settings.max_entry_bytes * 4:
            return None
        if ex.stream:
            usage = outcome.usage if outcome.usage_source == "upstream" else None
            data = completion.finished(ex.endpoint, body, usage)  # None: cut short, never stored
        else:
            try:
                answer = orjson.loads(body)
            except orjson.JSONDecodeError:
                return None
            if not isinstance(answer, dict) or answer.get("error"):
                return None
            if ex.endpoint == "responses":
                if answer.get("status") != "completed":
                    return None  # failed, incomplete, queued or in progress: never stored
            elif not answer.get("choices") or not all(c.get("finish_reason") for c in answer["choices"]):
                return None  # cut short upstream: never stored
            data = body
        return data if data is not None and len(data) <= self.settings.max_entry_bytes else None

    def _count(self, counter: str, ex: Exchange, *value: str) -> None:
        labels = (counter, self.tenant_label(ex.tenant), ex.model, *value)
        child = self._counted.get(labels)
        if child is None:
            series = getattr(self, counter)
            if series is None:  # not started (a unit test of the hooks)
                return
            child = self._counted[labels] = series.labels(*labels[1:])
        child.inc()


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
