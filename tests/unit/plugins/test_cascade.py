"""The cascade's checks on whole chat answers, and the simulator's scripted failure mix that exercises them."""

from __future__ import annotations

import collections
from typing import Any

import orjson
import pytest

from gateway.simulation import faults
from gateway.simulation.answers import Profile, _canonical, simulate
from plugins.cascade.checks import verdict, without_logprobs
from plugins.cascade.config import CascadeSpec

SPEC = CascadeSpec(small="s", min_mean_logprob=-1.0)
JSON_ASKED = {"response_format": {"type": "json_object"}}


def answer(content: Any = '{"a": 1}', finish: str = "stop", **message: Any) -> dict[str, Any]:
    tokens = [{"token": "a", "logprob": -0.1}]
    choice = {"message": {"content": content, **message}, "finish_reason": finish, "logprobs": {"content": tokens}}
    return {"choices": [choice]}


def test_a_good_answer_passes() -> None:
    assert verdict(answer(), JSON_ASKED, SPEC) is None


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (answer(""), "empty"),
        (answer("   "), "empty"),
        (answer(None), "empty"),
        (answer(finish="length"), "length"),
        (answer('{"a": '), "json"),
        (answer("[1, 2]"), "json"),  # a JSON response format asks for an object
        (answer(None, tool_calls=[{"function": {"name": "f", "arguments": '{"q": '}}]), "tool_args"),
        ({"choices": []}, "invalid"),
        ({"error": {}}, "invalid"),
    ],
)
def test_each_check(document: dict[str, Any], reason: str) -> None:
    assert verdict(document, JSON_ASKED, SPEC) == reason


def test_json_is_checked_only_when_asked_for_and_checks_can_be_left_out() -> None:
    assert verdict(answer("plain words"), {}, SPEC) is None
    assert verdict(answer(""), {}, CascadeSpec(small="s", checks=("length",))) is None


def test_log_probabilities() -> None:
    low = answer()
    low["choices"][0]["logprobs"]["content"] = [{"logprob": -3.0}, {"logprob": -2.0}]
    assert verdict(low, {}, SPEC) == "logprob"
    none = answer()
    none["choices"][0]["logprobs"] = None
    assert verdict(none, {}, SPEC) == "logprob"  # nothing to judge by
    assert verdict(none, {}, CascadeSpec(small="s")) is None  # no bound, no check
    assert orjson.loads(without_logprobs(low))["choices"][0]["logprobs"] is None


def test_the_scripted_mix_holds_its_shares_and_each_kind_fails_its_check() -> None:
    mix = tuple((kind, 0.1) for kind in faults.KINDS)
    profile = Profile(ttft_ms=0, tpot_ms=0, tokens=8, failures=mix)
    tools = [{"type": "function", "function": {"name": "f"}}]
    seen: collections.Counter[str | None] = collections.Counter()
    for i in range(3000):
        messages = [{"role": "user", "content": f"q {i}"}]
        body = {"model": "m", "messages": messages, "logprobs": True, **JSON_ASKED}
        if i % 2:
            body["tools"] = tools
        reply = simulate("chat/completions", body, "small", profile)
        fault = faults.pick(mix, b"fault\0" + _canonical(messages, "messages"))
        seen[fault] += 1
        judged = verdict(orjson.loads(reply.pieces[0]), body, SPEC)
        expected = None if fault == "json" and i % 2 else fault  # a tool call has no content to spoil
        expected = None if fault == "tool_args" and not i % 2 else expected  # no tools asked, no call
        assert judged == expected, (i, fault, reply.pieces[0])
    for kind in faults.KINDS:
        assert 0.07 < seen[kind] / 3000 < 0.13, seen
