"""The Responses API's pieces on their own: its stream made and read back, its first token, its usage."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from openai.types.responses import Response

from gateway.jobs.recorder import queued_response
from gateway.jobs.store import Job, MemoryJobs, terminal_event
from gateway.server.relay import find_usage
from gateway.simulation.answers import SSE, Profile, simulate
from gateway.wire import completion
from gateway.wire.marks import CHAT_RULES, RESPONSES_RULES, stream_rules

PROFILE = Profile(ttft_ms=100.0, tpot_ms=10.0, tokens=6)


def respond(**fields: Any) -> Any:
    return simulate("responses", {"model": "m", "input": "hello there", **fields}, "served", PROFILE)


def test_the_simulated_response_is_a_valid_response_object() -> None:
    reply = respond(max_output_tokens=4, instructions="be brief")
    response = Response.model_validate(orjson.loads(reply.pieces[0]))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert len(response.output_text.split()) == 4
    assert response.model == "served"
    assert response.usage is not None
    assert response.usage.input_tokens == 4
    assert response.usage.total_tokens == 8
    assert reply.ttft_s == pytest.approx(0.1 + 3 * 0.01)  # the whole answer once it would have been generated
    ident = orjson.loads(respond().pieces[0])["id"]
    assert ident == orjson.loads(respond().pieces[0])["id"]  # the same request, the same response
    assert ident != orjson.loads(respond(input="something else").pieces[0])["id"]


def test_the_simulated_stream_has_its_first_token_in_the_first_piece() -> None:
    reply = respond(stream=True)
    assert reply.content_type == SSE
    assert len(reply.pieces) == 6  # one piece per token, as for chat
    assert RESPONSES_RULES.first_token.search(reply.pieces[0])
    assert not RESPONSES_RULES.first_token.search(reply.pieces[0].split(b"response.output_text.delta")[0])
    assert RESPONSES_RULES.end.search(reply.pieces[-1])
    assert not CHAT_RULES.end.search(reply.pieces[-1])
    body = b"".join(reply.pieces)
    events = [orjson.loads(line[6:]) for line in body.splitlines() if line.startswith(b"data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert completion.assemble("responses", body) == events[-1]["response"]
    assert find_usage(body[-2048:]) == {**events[-1]["response"]["usage"], "prompt_tokens": 2, "completion_tokens": 6}


def test_a_replay_reads_back_as_the_response_it_was_made_from() -> None:
    response = orjson.loads(respond(stream=False).pieces[0])
    replayed = completion.replay("responses", response, include_usage=True)
    assert completion.assemble("responses", replayed) == response
    events = [orjson.loads(line[6:]) for line in replayed.splitlines() if line.startswith(b"data: ")]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == response["output"][0]["content"][0]["text"]
    assert completion.assemble("responses", replayed.rsplit(b"event: response.completed", 1)[0]) is None


@pytest.mark.parametrize(
    "event",
    [
        b"event: response.output_text.delta\ndata: {}",
        b'data: {"type":"response.function_call_arguments.delta","delta":"{"}',
        b'data: {"type":"response.reasoning_summary_text.delta","delta":"x"}',
        b'data: {"type":"response.refusal.delta","delta":"no"}',
    ],
)
def test_the_first_output_of_any_kind_is_a_first_token(event: bytes) -> None:
    assert stream_rules("responses").first_token.search(event)
    assert stream_rules("chat/completions") is CHAT_RULES


def test_preamble_events_are_not_a_first_token() -> None:
    for kind in ("response.created", "response.in_progress", "response.output_item.added"):
        assert not RESPONSES_RULES.first_token.search(f"event: {kind}\ndata: {{}}".encode())


def test_memory_jobs_end_once_append_nothing_after_and_cap_per_tenant() -> None:
    async def scenario() -> None:
        jobs = MemoryJobs(ttl_s=60, max_events=16)
        job = Job("resp_1", "responses", "acme", "m", "me", "queued", b"{}")
        assert await jobs.create(job, cap=1)
        assert not await jobs.create(Job("resp_2", "responses", "acme", "m", "me", "queued", b"{}"), 1)
        assert await jobs.create(Job("resp_3", "responses", "rival", "m", "me", "queued", b"{}"), 1)
        assert await jobs.append(job, [(i, b"e%d" % i) for i in range(10)], b'{"status":"in_progress"}')
        assert (await jobs.get("resp_1") or job).status == "in_progress"
        # A write repeated after a timeout that had landed after all: only what was not there is stored.
        assert await jobs.append(job, [(i, b"e%d" % i) for i in range(8, 20)], None)
        assert [seq for seq, _ in await jobs.events("resp_1", after=-1)] == list(range(4, 20))  # bounded
        assert [seq for seq, _ in await jobs.events("resp_1", after=17)] == [18, 19]
        stranger = Job("resp_1", "responses", "acme", "m", "someone else", "queued", b"{}")
        assert not await jobs.append(stranger, [(20, b"e20")], None)  # only its owner writes
        assert await jobs.finish(job, "cancelled", b'{"status":"cancelled"}', "response.failed")
        assert not await jobs.finish(job, "completed", b"{}", "response.completed")
        assert not await jobs.append(job, [(21, b"late")], None)
        events = await jobs.events("resp_1", after=-1)
        assert events[-1] == (20, terminal_event("response.failed", 20, b'{"status":"cancelled"}'))
        terminal = orjson.loads(events[-1][1].partition(b"data: ")[2])
        assert terminal == {"type": "response.failed", "sequence_number": 20, "response": {"status": "cancelled"}}
        found = await jobs.get("resp_1")
        assert found is not None
        assert found.status == "cancelled"
        assert (await jobs.renew("me", [job])).ended == {"resp_1": "cancelled"}
        assert await jobs.create(Job("resp_4", "responses", "acme", "m", "me", "queued", b"{}"), 1)

    asyncio.run(scenario())


def test_a_queued_background_response_is_a_valid_response_object() -> None:
    body = {"model": "m", "input": "x", "background": True, "instructions": "be brief", "metadata": {"k": "v"}}
    response = Response.model_validate(queued_response("resp_abc", body, 1700000000))
    assert response.status == "queued"
    assert response.background
    assert response.output == []
    assert response.instructions == "be brief"
    assert response.metadata == {"k": "v"}
