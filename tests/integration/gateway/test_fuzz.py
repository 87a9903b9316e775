"""Generated requests against the running gateway: whatever a client sends, no 5xx, no hang, and every 4xx in
OpenAI's error format.

A few hundred examples by default, the same ones every run (derandomized, no example database), so the suite
stays green and fast; `SLUICE_FUZZ_EXAMPLES=5000` runs that many random ones.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway import RunningGateway, gateway_thread

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "0") or 0)
CONFIG = """
backends: {sim: {type: simulated, ttft_ms: 0, tpot_ms: 0, tokens: 3}}
models:
  chat-large: {backend: sim, upstream_model: large, fallback: [chat-small]}
  chat-small: {backend: sim}
  embed-small: {backend: sim, upstream_model: embed}
cache: {mode: always}
plugins: [cache, slo]
limits: {max_body_bytes: 65536}
"""
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/chat/completions",
    "/embeddings",
    "/openai/deployments/chat-small/chat/completions",
    "/openai/deployments/nope/embeddings",
    "/openai/deployments//chat/completions",
    "/openai/deployments/chat-small/nothing",
    "/openai/v1/chat/completions",
    "/openai/v1/deployments/chat-large/completions",
    "/v1/models",
    "/healthz",
    "/readyz",
    "/status",
    "/metrics",
    "/v1/unknown",
]
ODD_PATH = r"/[A-Za-z0-9_.~-]{0,24}(/[A-Za-z0-9_.~-]{0,12}){0,3}"
MODELS = ["chat-large", "chat-small", "embed-small", "unknown", ""]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | values},
        optional={"content": st.text(max_size=60) | values, "name": values},
    )
    | values,
    max_size=4,
)
requests = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | values},
    optional={
        "messages": messages | values,
        "prompt": st.text(max_size=40) | values,
        "input": st.lists(st.text(max_size=20), max_size=3) | values,
        "stream": st.sampled_from([True, False, None, "yes", 1]),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}) | values,
        "max_tokens": st.integers(min_value=-5, max_value=10**20) | values,
        "temperature": st.floats(allow_nan=True) | values,
        "dimensions": st.integers(min_value=-5, max_value=10**6) | values,
        "tools": values,
        "extra": values,
    },
)


def nested(depth: int) -> bytes:
    return b'{"model":"chat-small","messages":[{"role":"user","content":' + b"[" * depth + b"]" * depth + b"}]}"


bodies = (
    requests.map(lambda r: json.dumps(r).encode())  # NaN and Infinity included: not JSON
    | st.binary(max_size=300)
    | st.integers(min_value=1, max_value=1500).map(nested)
    | st.text(max_size=80).map(lambda t: json.dumps({"model": "chat-small", "messages": t}).encode())
    | st.sampled_from([b'{"model":"\\ud800","messages":[{"role":"user","content":"\\udfff"}]}', b"{}", b"null"])
)
# Values an HTTP client can send at all (no control characters, no surrounding blanks).
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(str.strip)


@st.composite
def exchange(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(bodies)
    encoding = draw(st.sampled_from([None, None, "gzip", "deflate", "br", "identity", "GZip", "x, y"]))
    if encoding is not None and draw(st.booleans()):
        body = gzip.compress(body) if "gzip" in encoding.lower() else zlib.compress(body)
    headers = {"content-type": draw(st.sampled_from(["application/json", "text/plain", "", "application/json; x"]))}
    if encoding is not None:
        headers["content-encoding"] = encoding
    for name in ("x-request-id", "cache-control", "authorization", "traceparent", "api-key"):
        if draw(st.booleans()):
            headers[name] = draw(header_text)
    return {
        "method": draw(st.sampled_from(["POST", "POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"])),
        "path": draw(
            st.sampled_from(PATHS)
            | st.from_regex(r"/[A-Za-z0-9_.~-]{0,24}(/[A-Za-z0-9_.~-]{0,12}){0,3}", fullmatch=True)
        ),
        "headers": headers,
        "body": body,
    }


@pytest.fixture(scope="module")
def gateway() -> Iterator[RunningGateway]:
    with gateway_thread(CONFIG) as gw:
        yield gw


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as client:  # a hang is a failure, not a stalled run
        yield client


@settings(
    max_examples=EXAMPLES or 300,
    derandomize=not EXAMPLES,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=exchange())
def test_any_request_gets_an_answer_in_the_right_shape(
    gateway: RunningGateway, http: httpx.Client, case: dict[str, Any]
) -> None:
    response = http.request(case["method"], gateway.url + case["path"], headers=case["headers"], content=case["body"])
    response.read()
    assert response.status_code < 500, (case, response.status_code, response.text[:500])
    assert response.headers.get("x-request-id") or response.status_code < 400, "an error without a request id"
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/json"), response.text[:200]
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["message"], error
