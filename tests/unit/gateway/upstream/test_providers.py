"""Providers' request building: each kind's path, credential header and body, on a built Exchange, with no
connection opened; and the Provider protocol's report, address and endpoints as callers read them."""

from __future__ import annotations

import orjson
import pytest

from gateway import errors
from gateway.config import parse
from gateway.context import Exchange, Target
from gateway.upstream.attempts import Upstreams
from gateway.upstream.providers.base import Provider, View

CONFIG = """
backends:
  openai: {type: openai, base_url: "http://127.0.0.1:9/v1", api_key: sk-one}
  azure: {type: azure, base_url: "https://res.openai.azure.com", api_key: az-key, api_version: "2024-10-21"}
  azure_old: {type: azure, base_url: "https://res.openai.azure.com", api_key: az-key, api_version: "2024-06-01"}
  azure_v1: {type: azure, base_url: "https://res.openai.azure.com/openai", api_key: az-key, api_version: v1}
  anthropic: {type: anthropic, base_url: "http://127.0.0.1:9/v1", api_key: an-key}
  vllm: {type: vllm, base_url: "http://127.0.0.1:9/v1"}
  sim: {type: simulated}
models:
  gpt: {backend: openai, upstream_model: gpt-4o}
  same: {backend: openai}
  deployed: {backend: azure, upstream_model: my deployment}
  old: {backend: azure_old, upstream_model: dep}
  deployed_v1: {backend: azure_v1, upstream_model: dep}
  claude: {backend: anthropic}
  local: {backend: vllm}
  simulated: {backend: sim}
"""


@pytest.fixture(scope="module")
def upstreams() -> Upstreams:
    return Upstreams(parse(CONFIG))


def exchange(body: dict[str, object], endpoint: str = "chat/completions") -> Exchange:
    raw = orjson.dumps(body)
    return Exchange("req-1", endpoint, [], raw, orjson.loads(raw), 0.0)


def chat(model: str, **fields: object) -> Exchange:
    return exchange({"model": model, "messages": [{"role": "user", "content": "hi"}], **fields})


def target(upstreams: Upstreams, model: str) -> Target:
    return upstreams.targets[model]


def test_openai_writes_its_path_bearer_key_and_the_upstream_model(upstreams: Upstreams) -> None:
    provider = upstreams.http["openai"]
    gpt = target(upstreams, "gpt")
    ex = chat("gpt")
    assert provider.path(ex, gpt) == b"/v1/chat/completions"
    assert b"authorization: Bearer sk-one\r\n" in provider.static_headers
    assert orjson.loads(provider.body(ex, gpt))["model"] == "gpt-4o"
    assert provider.url == "http://127.0.0.1:9/v1"


def test_a_body_that_needs_no_change_is_sent_as_the_client_sent_it(upstreams: Upstreams) -> None:
    provider = upstreams.http["openai"]
    ex = chat("same")
    assert provider.body(ex, target(upstreams, "same")) is ex.body


def test_a_stream_is_asked_for_its_usage_without_losing_the_clients_fields(upstreams: Upstreams) -> None:
    provider = upstreams.http["openai"]
    ex = chat("same", stream=True, temperature=0)
    ex.stream = True
    sent = orjson.loads(bytes(provider.body(ex, target(upstreams, "same"))))
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["temperature"] == 0
    assert sent["messages"] == ex.json["messages"]


def test_azure_dated_puts_the_deployment_in_the_path_and_the_key_in_api_key(upstreams: Upstreams) -> None:
    provider = upstreams.http["azure"]
    deployed = target(upstreams, "deployed")
    ex = chat("deployed")
    assert provider.path(ex, deployed) == b"/openai/deployments/my%20deployment/chat/completions?api-version=2024-10-21"
    assert b"api-key: az-key\r\n" in provider.static_headers
    assert b"authorization" not in provider.static_headers
    assert orjson.loads(provider.body(ex, deployed))["model"] == "deployed"  # the path selects the model
    assert provider.reports_usage


def test_azure_before_stream_options_estimates_stream_usage(upstreams: Upstreams) -> None:
    assert not upstreams.http["azure_old"].reports_usage


def test_azure_v1_names_the_deployment_in_the_body(upstreams: Upstreams) -> None:
    provider = upstreams.http["azure_v1"]
    dep = target(upstreams, "deployed_v1")
    ex = chat("deployed_v1")
    assert provider.path(ex, dep) == b"/openai/v1/chat/completions"
    assert orjson.loads(provider.body(ex, dep))["model"] == "dep"


def test_azure_responses_have_no_deployment_in_the_path(upstreams: Upstreams) -> None:
    ex = exchange({"model": "deployed", "input": "hi"}, "responses")
    assert upstreams.http["azure"].path(ex, target(upstreams, "deployed")) == (
        b"/openai/responses?api-version=2024-10-21"
    )
    ex.resource = "/resp_1?stream=true"
    assert upstreams.http["azure"].path(ex, target(upstreams, "deployed")) == (
        b"/openai/responses/resp_1?api-version=2024-10-21&stream=true"
    )
    assert upstreams.http["azure_v1"].path(ex, target(upstreams, "deployed_v1")) == (
        b"/openai/v1/responses/resp_1?stream=true"
    )


async def test_anthropic_refuses_openai_shaped_requests_before_sending(upstreams: Upstreams) -> None:
    provider = upstreams.http["anthropic"]
    assert b"x-api-key: an-key\r\n" in provider.static_headers
    claude = target(upstreams, "claude")
    ex = chat("claude")
    with pytest.raises(errors.BadRequestError) as refused:
        await provider.send(ex, claude)
    assert refused.value.code == "messages_only"
    ex.targets = [target(upstreams, "gpt"), claude]  # only a fallback: passed over like a failed target
    with pytest.raises(errors.UpstreamError):
        await provider.send(ex, claude)


def test_a_self_hosted_backend_without_a_key_sends_no_credential(upstreams: Upstreams) -> None:
    provider = upstreams.http["vllm"]
    assert b"authorization" not in provider.static_headers
    assert provider.path(chat("local"), target(upstreams, "local")) == b"/v1/chat/completions"


def test_every_provider_reports_its_state_address_and_endpoints(upstreams: Upstreams) -> None:
    assert set(upstreams.http) == set(upstreams.providers) - {"sim"}
    report = upstreams.report()
    assert set(report) == set(upstreams.providers)
    assert all("state" in state for state in report.values())
    simulated = upstreams.providers["sim"]
    assert simulated.url is None
    assert simulated.in_service() == 1
    assert upstreams.providers["azure"].url == "https://res.openai.azure.com"


class Viewed(View):
    async def send(self, ex: Exchange, target: Target) -> object:
        raise AssertionError("not sent")


def test_a_view_of_a_backend_is_the_backend_but_for_sending(upstreams: Upstreams) -> None:
    inner: Provider = upstreams.providers["azure"]
    view = Viewed(inner)
    assert (view.kind, view.system, view.url) == ("azure", "azure.ai.openai", inner.url)
    assert view.health is inner.health
    assert view.reports_usage == inner.reports_usage
    assert view.report() == inner.report()
    assert view.in_service() == inner.in_service()
    assert view.ready == inner.ready
