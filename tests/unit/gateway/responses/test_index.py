"""The ownership index on its own: it fails closed when Redis cannot answer, and keeps what it could not write."""

from __future__ import annotations

import pytest

from gateway.responses.index import ITEM_ADDED, ITEM_ID, MAX_PENDING, Owner, ResponseIndex, index_key, item_key
from gateway.state.store import Store, StoreUnavailable
from tests.support.gateway import free_port

ACME = Owner("acme", "gpt")


async def test_without_redis_the_process_is_the_authority() -> None:
    index = ResponseIndex(None, 60.0)
    index.note("resp_1", ACME)
    assert await index.lookup("resp_1") == ACME
    assert await index.lookup("resp_2") is None  # unknown, not guessed
    await index.forget("resp_1")
    assert await index.lookup("resp_1") is None


async def test_an_unreachable_redis_fails_closed_and_nothing_noted_is_lost() -> None:
    store = Store(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there: every call is refused
    index = ResponseIndex(store, 60.0)
    try:
        index.note("resp_made_here", ACME)
        index.note_items(["msg_1"], ACME)
        # What this process noted is read from what it kept; anything else cannot be known: an error, not None.
        assert await index.owners([index_key("resp_made_here"), item_key("msg_1")]) == [ACME, ACME]
        with pytest.raises(StoreUnavailable):
            await index.lookup("resp_made_elsewhere")
        await index.forget("resp_made_here")  # kept as a delete, to be written: no longer readable here
        assert await index.lookup("resp_made_here") is None
        assert set(index.pending) == {index_key("resp_made_here"), item_key("msg_1")}
    finally:
        await index.aclose()
        await store.aclose()


async def test_a_full_backlog_refuses_more() -> None:
    store = Store(f"redis://127.0.0.1:{free_port()}/0")
    index = ResponseIndex(store, 60.0)
    try:
        index.note_items([f"msg_{i}" for i in range(MAX_PENDING)], ACME)
        assert index.full
        index.note("resp_one_too_many", ACME)
        assert index.dropped == 1
        assert index_key("resp_one_too_many") not in index.pending
    finally:
        await store.aclose()


def test_output_item_ids_are_found_and_nothing_else() -> None:
    event = (
        b'event: response.output_item.added\ndata: {"type":"'
        + ITEM_ADDED
        + b'","item":{"id":"msg_abc","type":"message"},'
        b'"response":{"id":"resp_x","conversation":{"id":"conv_y"},"prompt":{"id":"pmpt_z"}},"item_id":"fc_no",'
        b'"previous_response_id":"resp_p","call_id":"call_q"}\n\n'
    )
    assert ITEM_ID.findall(event) == [b"msg_abc"]
