"""Bad input gets an OpenAI-format error with the right status: never a 500, a hang or a mixed-up answer."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.gateway import RunningGateway, gateway_thread

CHAT = b'{"model":"chat-small","messages":[{"role":"user","content":"hi"}]}'


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages":[{"role":"user","content":"hi"}]}', "model"),
        (b'{"model":7,"messages":[]}', "model"),
        (b'{"model":"chat-small"}', "messages"),
        (b'{"model":"chat-small","messages":"hi"}', "messages"),
        (b'{"model":"chat-small","messages":[]}', "messages"),
        (b'{"model":"chat-small","messages":[{"role":"user","content":"hi"}],"stream":"yes"}', "stream"),
        # A field the gateway decides on, given twice: one parser could judge the first, another serve the last.
        (b'{"model":"chat-small","messages":[{"role":"user","content":"hi"}],"model" : "chat-large"}', "model"),
        (
            b'{"model":"chat-small","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"max_tokens":9}',
            "max_tokens",
        ),
    ],
)
def test_malformed_requests_get_400(quickstart: RunningGateway, body: bytes, param: str | None) -> None:
    response = httpx.post(f"{quickstart.base_url}/chat/completions", content=body)
    error = assert_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_missing_fields_per_endpoint(quickstart: RunningGateway) -> None:
    assert_error(httpx.post(f"{quickstart.base_url}/completions", json={"model": "chat-small"}), 400)
    assert_error(httpx.post(f"{quickstart.base_url}/embeddings", json={"model": "embed-small"}), 400)
    streamed = {"model": "embed-small", "input": "x", "stream": True}
    assert_error(httpx.post(f"{quickstart.base_url}/embeddings", json=streamed), 400)


def test_unknown_model_is_404_for_the_sdk(quickstart: RunningGateway) -> None:
    client = openai.OpenAI(base_url=quickstart.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"


def test_wrong_method_and_unknown_path(quickstart: RunningGateway) -> None:
    response = httpx.get(f"{quickstart.base_url}/chat/completions")
    assert_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"
    assert_error(httpx.get(f"{quickstart.url}/v2/nothing"), 404, "unknown_url")
    assert_error(httpx.post(f"{quickstart.url}/v1/models"), 405)


def test_body_over_the_limit_is_413(quickstart: RunningGateway) -> None:
    big = b'{"model":"chat-small","messages":[{"role":"user","content":"' + b"x" * 70000 + b'"}]}'
    assert_error(httpx.post(f"{quickstart.base_url}/chat/completions", content=big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: the cap must hold while reading
        yield big[:30000]
        yield big[30000:]

    assert_error(httpx.post(f"{quickstart.base_url}/chat/completions", content=chunks()), 413)


def test_gzip_body_is_decompressed(quickstart: RunningGateway) -> None:
    response = httpx.post(
        f"{quickstart.base_url}/chat/completions", content=gzip.compress(CHAT), headers={"content-encoding": "gzip"}
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    deflated = httpx.post(
        f"{quickstart.base_url}/chat/completions", content=zlib.compress(CHAT), headers={"content-encoding": "deflate"}
    )
    assert deflated.status_code == 200, deflated.text


def test_gzip_bomb_is_413_not_memory(quickstart: RunningGateway) -> None:
    bomb = gzip.compress(b"{" + b" " * (50 * 1024 * 1024) + b"}")
    assert len(bomb) < 65536
    response = httpx.post(f"{quickstart.base_url}/chat/completions", content=bomb, headers={"content-encoding": "gzip"})
    assert_error(response, 413)


def test_bad_encodings(quickstart: RunningGateway) -> None:
    url = f"{quickstart.base_url}/chat/completions"
    assert_error(httpx.post(url, content=b"not gzip", headers={"content-encoding": "gzip"}), 400)
    assert_error(httpx.post(url, content=CHAT, headers={"content-encoding": "br"}), 415)


def test_azure_style_path_routes_by_deployment(quickstart: RunningGateway) -> None:
    client = openai.AzureOpenAI(
        azure_endpoint=quickstart.url, api_version="2024-10-21", api_key="unused", max_retries=0
    )
    answer = client.chat.completions.create(model="chat-small", messages=[{"role": "user", "content": "hi"}])
    assert answer.model == "small"
    assert answer.choices[0].message.content


def test_a_bug_in_a_plugin_is_a_500_in_openai_format() -> None:
    config = """
backends: {sim: {type: simulated, ttft_ms: 1, tpot_ms: 0, tokens: 2}}
models: {m: {backend: sim}}
plugins: ["tests.support.plugins:Broken"]
"""
    with gateway_thread(config) as gw:
        url = f"{gw.base_url}/chat/completions"
        broken = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "break"}]})
        error = assert_error(broken, 500, "internal_error")
        assert "RuntimeError" in str(error["message"])
        fine = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert fine.status_code == 200


def test_rejected_requests_are_counted(quickstart: RunningGateway) -> None:
    def rejected() -> float:
        text = httpx.get(f"{quickstart.url}/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sluice_requests_total{") and 'tenant="unknown"' in line and 'status="400"' in line
        )

    before = rejected()
    httpx.post(f"{quickstart.base_url}/chat/completions", content=b"{not json")
    assert rejected() == before + 1


def nested(depth: int) -> bytes:
    """A chat request whose first message's content nests `depth` levels deep, counting the body itself."""
    inner = "[" * (depth - 3) + '"x"' + "]" * (depth - 3)
    return b'{"model":"chat-small","messages":[{"role":"user","content":"hi","extra":' + inner.encode() + b"}]}"


@pytest.mark.parametrize("depth", [300, 1000, 2000])
def test_deep_nesting_is_400_not_500(quickstart: RunningGateway, depth: int) -> None:
    response = httpx.post(f"{quickstart.base_url}/chat/completions", content=nested(depth))
    assert_error(response, 400)
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("depth", [100, 128])
def test_nesting_up_to_the_limit_is_accepted(quickstart: RunningGateway, depth: int) -> None:
    response = httpx.post(f"{quickstart.base_url}/chat/completions", content=nested(depth))
    assert response.status_code == 200, response.text


def test_every_error_has_a_request_id(quickstart: RunningGateway) -> None:
    wrong_method = httpx.get(f"{quickstart.base_url}/chat/completions")
    assert len(wrong_method.headers["x-request-id"]) == 32
    echoed = httpx.get(f"{quickstart.base_url}/chat/completions", headers={"x-request-id": "mine"})
    assert echoed.headers["x-request-id"] == "mine"


def test_azure_v1_form_and_an_openai_client_on_it(quickstart: RunningGateway) -> None:
    plain = openai.OpenAI(base_url=f"{quickstart.url}/openai/v1", api_key="unused", max_retries=0)
    assert plain.chat.completions.create(model="chat-small", messages=[{"role": "user", "content": "hi"}]).choices
    assert "chat-small" in [m.id for m in plain.models.list()]
    azure = openai.AzureOpenAI(
        base_url=f"{quickstart.url}/openai/v1", api_version="preview", api_key="unused", max_retries=0
    )
    assert azure.chat.completions.create(model="chat-small", messages=[{"role": "user", "content": "hi"}]).choices
