"""The RESP client's parts that need no server: encoding, URLs, hash slots, replies arriving byte by byte."""

from __future__ import annotations

import asyncio
import contextlib

import hiredis
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.state.cluster import key_of, slot
from gateway.state.resp import Batch, Connection, Node, Options, ReplyError, encode, node_urls, parse_url


def test_commands_are_encoded_as_arrays_of_bulk_strings() -> None:
    assert encode(("SET", b"k\r\n", 5, 0.5)) == b"*4\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$1\r\n5\r\n$3\r\n0.5\r\n"


ARGS = st.one_of(
    st.sampled_from(["GET", "SET", "PX", "EVALSHA"]),
    st.text(max_size=40),
    st.binary(max_size=3000),  # across the inline size of a bulk string's header (1024)
    st.integers(min_value=-(2**63), max_value=2**63),
)


@given(st.lists(ARGS, min_size=1, max_size=20))
def test_any_command_is_read_back_as_its_arguments(command: list[str | bytes | int]) -> None:
    reader = hiredis.Reader()
    reader.feed(encode(command))
    as_bytes = [a if isinstance(a, bytes) else a.encode() if isinstance(a, str) else b"%d" % a for a in command]
    assert reader.gets() == as_bytes
    assert reader.gets() is False  # nothing left over


def test_urls_give_addresses_credentials_database_and_tls() -> None:
    addresses, options, cluster = parse_url("redis://u%40x:p%3Aw@10.0.0.1:6380/3")
    assert addresses == [("10.0.0.1", 6380)]
    assert not cluster
    assert (options.username, options.password, options.db, options.tls) == ("u@x", "p:w", 3, None)
    addresses, options, cluster = parse_url("rediss+cluster://:secret@a:7000,b:7001,[::1]:7002", timeout_s=0.1)
    assert addresses == [("a", 7000), ("b", 7001), ("::1", 7002)]
    assert cluster
    assert options.password == "secret"
    assert options.username is None
    assert options.tls is not None
    assert options.timeout_s == 0.1
    assert parse_url("redis://localhost")[0] == [("localhost", 6379)]
    with pytest.raises(ValueError, match="scheme"):
        parse_url("http://localhost:6379")


def test_a_cluster_url_gives_one_plain_url_per_seed_for_library_clients() -> None:
    assert node_urls("rediss+cluster://u:p@a:1,b:2?ssl_cert_reqs=none") == [
        "rediss://u:p@a:1?ssl_cert_reqs=none",
        "rediss://u:p@b:2?ssl_cert_reqs=none",
    ]
    assert node_urls("redis://h:6379/2") == ["redis://h:6379/2"]


def test_hash_slots_match_redis_and_honour_hash_tags() -> None:
    assert slot("foo") == 12182  # CLUSTER KEYSLOT foo
    assert slot("123456789") == 0x31C3 % 16384  # the CRC16-XMODEM check value
    assert slot("sluice:rl:{acme}:tokens") == slot("sluice:rl:{acme}:requests") == slot("acme")
    assert slot("a{}b") != slot("")  # an empty tag is no tag: the whole key counts
    assert slot(b"x{y}z{w}") == slot("y")


def test_scripts_are_routed_by_their_first_key_and_keyless_commands_by_none() -> None:
    assert key_of(("EVALSHA", "abc", 2, "k1", "k2", "arg")) == "k1"
    assert key_of(("EVALSHA", "abc", 0, "arg")) is None
    assert key_of(("GET", "k")) == "k"
    assert key_of(("PING",)) is None
    assert key_of(("SCRIPT", "LOAD", "x")) is None


async def test_replies_split_anywhere_reach_their_callers_in_order() -> None:
    loop = asyncio.get_running_loop()
    connection = Connection(lambda _: None)
    first, second, third = loop.create_future(), loop.create_future(), loop.create_future()
    batch = Batch(third, 2)
    for waiter in (first, second, batch):
        connection.expect(waiter)
    stream = b"$5\r\nhello\r\n-ERR wrong\r\n*2\r\n:1\r\n$-1\r\n+OK\r\n"
    for i in range(len(stream)):
        connection.data_received(stream[i : i + 1])
        if i < 10:
            assert not first.done()
    assert first.result() == b"hello"
    with pytest.raises(ReplyError, match="ERR wrong"):
        second.result()
    assert third.result() == [[1, None], b"OK"]
    assert not connection.pending


async def test_a_reply_for_a_call_that_gave_up_is_dropped_in_its_turn() -> None:
    loop = asyncio.get_running_loop()
    connection = Connection(lambda _: None)
    gone, waiting = loop.create_future(), loop.create_future()
    gone.cancel()
    connection.expect(gone)
    connection.expect(waiting)
    connection.data_received(b"$5\r\nstale\r\n$5\r\nfresh\r\n")
    assert waiting.result() == b"fresh"


class Wire(asyncio.Transport):
    """The socket under a Connection: records what is written, as one entry per write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing


async def test_the_commands_of_one_loop_iteration_go_out_in_one_write() -> None:
    loop = asyncio.get_running_loop()
    connection = Connection(lambda _: None, timeout_s=5.0)
    wire = Wire()
    connection.connection_made(wire)
    futures = [loop.create_future() for _ in range(100)]
    for i, future in enumerate(futures):
        connection.send(encode(("GET", f"k{i}")), future)
    # The first went out at once (nothing was in flight); the others wait for the iteration to end.
    assert wire.writes == [encode(("GET", "k0"))]
    await asyncio.sleep(0)
    assert wire.writes == [encode(("GET", "k0")), b"".join(encode(("GET", f"k{i}")) for i in range(1, 100))]
    connection.data_received(b"".join(b"$2\r\nv%d\r\n" % (i % 10) for i in range(100)))
    assert [f.result() for f in futures] == [b"v%d" % (i % 10) for i in range(100)]
    connection.send(encode(("PING",)), loop.create_future())
    assert len(wire.writes) == 3  # idle again: written at once


async def test_calls_fail_at_their_own_deadlines_in_order_and_later_replies_still_match() -> None:
    loop = asyncio.get_running_loop()
    connection = Connection(lambda _: None, timeout_s=0.2)
    connection.connection_made(Wire())
    first = loop.create_future()
    connection.send(b"", first)
    await asyncio.sleep(0.1)
    second = loop.create_future()
    connection.send(b"", second)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first, 5.0)
    failed_first = loop.time()
    assert not second.done()  # its deadline is 0.1 s later
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(second, 5.0)
    assert loop.time() - failed_first >= 0.09
    third = loop.create_future()
    connection.send(b"", third)
    connection.data_received(b"+late\r\n+late\r\n+OK\r\n")  # the two late replies are dropped in their turn
    assert third.result() == b"OK"
    assert not connection.pending
    assert not connection.due
    assert connection.expired == 0


async def test_nothing_is_written_to_a_connection_being_aborted_and_its_calls_fail_when_it_is_lost() -> None:
    loop = asyncio.get_running_loop()
    connection = Connection(lambda _: None, timeout_s=5.0)
    wire = Wire()
    connection.connection_made(wire)
    wire.closing = True  # aborted: connection_lost comes on a later iteration
    first, second = loop.create_future(), loop.create_future()
    connection.send(encode(("GET", "a")), first)
    connection.send(encode(("GET", "b")), second)
    await asyncio.sleep(0)
    assert wire.writes == []
    connection.connection_lost(None)
    for future in (first, second):
        with pytest.raises(ConnectionError):
            future.result()


async def test_a_connection_closed_as_it_opens_is_never_counted_live() -> None:
    # A server going down (or at its client limit) accepts and closes at once. The pool's refill used to loop
    # until it held every connection, so a call waiting on it waited for good; and a connection lost before it
    # was counted live stayed live, every other call failing on it at its deadline. A real socket server on
    # loopback that closes what it accepts.
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    node = Node("127.0.0.1", port, Options(connections=2, connect_timeout_s=1.0))
    try:
        loop = asyncio.get_running_loop()
        for _ in range(20):
            started = loop.time()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(node.call(("PING",)), 10.0)
            assert loop.time() - started < 10.0, "a call waited on a refill that never ends"
            node.retry_at = 0.0  # try again at once rather than a second later
            await asyncio.sleep(0.01)  # the closes arrive
            assert all(c.transport is not None for c in node.live), "a lost connection is counted live"
    finally:
        node.close()
        server.close()
        await server.wait_closed()
