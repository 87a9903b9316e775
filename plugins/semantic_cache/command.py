"""`sluice semantic evaluate` (also `sluice cache evaluate`): the command that measures the semantic cache's false
hits on labelled pairs (evaluation.py) and prints them (report.py).

It embeds the pairs through a model of the gateway's config (`-c CONFIG --model NAME`: the gateway's own pipeline
and pool, in this process) or any OpenAI-compatible `/v1/embeddings` (`--url URL --model NAME`), and optionally
asks a verifier (verifier.verify) about each pair the guards let through.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from plugins.semantic_cache.evaluation import (
    BUNDLED,
    TARGET_FHR,
    Embed,
    Evaluation,
    EvaluationError,
    evaluate,
    load_pairs,
    with_verifier,
)
from plugins.semantic_cache.report import as_json, explain, render
from plugins.semantic_cache.verifier import verify

if TYPE_CHECKING:
    from gateway.runtime import Runtime
    from gateway.settings import Settings

# -- embedding models


def _vectors(payload: Any, count: int) -> list[list[float]]:
    try:
        data = sorted(payload["data"], key=lambda d: d["index"])
        vectors = [[float(x) for x in d["embedding"]] for d in data]
    except (KeyError, TypeError, ValueError):
        raise EvaluationError("the embedding model's answer is not an OpenAI embeddings list", 1) from None
    if len(vectors) != count:
        raise EvaluationError(f"the embedding model returned {len(vectors)} vectors for {count} texts", 1)
    return vectors


def http_embedder(
    url: str, model: str, api_key: str = "", timeout_s: float = 120.0
) -> tuple[Embed, Callable[[], None]]:
    """An embedding function over any OpenAI-compatible `/v1/embeddings` (URL with or without the path)."""
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/embeddings"):
        endpoint += "/embeddings"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(timeout=timeout_s, headers=headers)

    def embed(texts: Sequence[str]) -> list[list[float]]:
        try:
            response = client.post(endpoint, json={"model": model, "input": list(texts), "encoding_format": "float"})
        except httpx.HTTPError as exc:
            raise EvaluationError(f"cannot reach {endpoint}: {exc}", 1) from None
        if response.status_code != 200:
            raise EvaluationError(f"{endpoint} answered {response.status_code}: {response.text[:300]}", 1)
        return _vectors(response.json(), len(texts))

    return embed, client.close


async def _through_pipeline(runtime: Runtime, model: str, texts: Sequence[str]) -> list[list[float]]:
    """One embeddings request driven through the gateway's pipeline in this process, as a client's would be."""
    body = orjson.dumps({"model": model, "input": list(texts), "encoding_format": "float"})
    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [(b"content-type", b"json")]}
    sent = False
    status = 0
    parts: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def collect(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            parts.append(message.get("body", b""))

    await runtime.intake.asgi(runtime.intake.openai, scope, receive, collect, "embeddings")
    answer = b"".join(parts)
    if status != 200:
        raise EvaluationError(f"model {model} answered {status}: {answer[:300].decode('utf-8', 'replace')}", 1)
    return _vectors(orjson.loads(answer), len(texts))


def config_embedder(settings: Settings, model: str) -> tuple[Embed, Callable[[], None]]:
    """An embedding function through the gateway's own pipeline (its providers, pool and routing), no plugins."""
    from gateway.runtime import Runtime

    if model not in settings.models:
        raise EvaluationError(f"no model named {model!r} in the config ({', '.join(sorted(settings.models))})")
    bare = settings.model_copy(update={"plugins": []})
    bare._plugin_config = {}
    loop = asyncio.new_event_loop()
    runtime = Runtime(bare)
    loop.run_until_complete(runtime.start())

    def embed(texts: Sequence[str]) -> list[list[float]]:
        return loop.run_until_complete(_through_pipeline(runtime, model, texts))

    def close() -> None:
        loop.run_until_complete(runtime.aclose())
        loop.close()

    return embed, close


# -- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("evaluate", help="precision, recall and false hits per threshold on labelled pairs")
    p.add_argument(
        "file",
        help='JSON Lines of {"a", "b", "same", "kind"}, or a bundled set: ' + ", ".join(name for name, _ in BUNDLED),
    )
    p.add_argument("-c", "--config", help="embed through this config's model (the gateway's own pipeline)")
    p.add_argument("--model", help="the embedding model: a model of the config, or the name sent to --url")
    p.add_argument("--url", help="an OpenAI-compatible base URL with /v1/embeddings, instead of the config")
    p.add_argument("--api-key", default="", help="a bearer key for --url")
    p.add_argument("--target-fhr", type=float, default=TARGET_FHR, help="false-hit rate to stay within (0.02)")
    p.add_argument("--every", type=int, default=1, help="print every n-th threshold of the curve (default 1)")
    p.add_argument("--explain", action="store_true", help="also list the false hits and the refused paraphrases")
    p.add_argument("--lenient", action="store_true", help="guards without the one-word substitution rule")
    p.add_argument(
        "--no-spelling", action="store_true", help="embed the texts as written (the gateway mends typos by default)"
    )
    p.add_argument(
        "--threshold", type=float, help="the threshold of the per-kind table and --explain (default: the suggestion)"
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    p.add_argument("--verifier-url", help="also ask this OpenAI-compatible chat endpoint whether pairs match")
    p.add_argument("--verifier-model", default="default", help="the verifier's model name")
    p.add_argument("--verifier-deadline-ms", type=float, default=500.0, help="each verifier call's bound (500)")


def _spelled(embed: Embed) -> Embed:
    """The embedder with the gateway's typo mending in front (semantic_cache.spelling, on by default)."""
    from plugins.semantic_cache.spelling import Speller

    speller = Speller()
    return lambda texts: embed([speller.fix(t) for t in texts])


async def _verified(args: argparse.Namespace, ev: Evaluation) -> Evaluation:
    deadline_s = args.verifier_deadline_ms / 1000
    async with httpx.AsyncClient() as client:

        async def ask(a: str, b: str) -> bool:
            return await verify(client, args.verifier_url, args.verifier_model, a, b, deadline_s, args.api_key)

        return await with_verifier(ev, ask, deadline_s)


def main(args: argparse.Namespace) -> int:
    name = "sluice semantic evaluate"
    try:
        if not 0 <= args.target_fhr <= 1:
            raise EvaluationError("--target-fhr is a fraction between 0 and 1, e.g. 0.02")
        if args.threshold is not None and not 0 < args.threshold <= 1:
            raise EvaluationError("--threshold is a cosine similarity between 0 and 1, e.g. 0.85")
        pairs = load_pairs(args.file)
        if args.url:
            embed, close = http_embedder(args.url, args.model or "default", args.api_key)
        else:
            from gateway.config import parse, read
            from gateway.settings import ConfigError

            if not args.model:
                raise EvaluationError("name the embedding model: --model NAME (a model of the config), or --url")
            try:
                settings = parse(*read(args.config))
            except ConfigError as exc:
                raise EvaluationError("; ".join(f"config error: {line}" for line in exc.lines)) from None
            embed, close = config_embedder(settings, args.model)
        if not args.no_spelling:
            embed = _spelled(embed)
        try:
            evaluation = evaluate(pairs, embed, args.target_fhr, strict=not args.lenient)
        finally:
            close()
        if args.verifier_url:
            evaluation = asyncio.run(_verified(args, evaluation))
    except EvaluationError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return exc.code
    if args.json:
        sys.stdout.write(orjson.dumps(as_json(evaluation, args.threshold), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        render(evaluation, sys.stdout, max(1, args.every), args.threshold)
        if args.explain:
            explain(evaluation, sys.stdout, args.threshold)
    return 0
