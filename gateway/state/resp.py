"""A lean Redis client for the request path: RESP2 over a few long-lived connections, replies parsed by hiredis.

Concurrent commands are pipelined: each is written at once to one of a node's connections and its future
joins that connection's FIFO; replies come back in order, so each reply settles the oldest future. A
call that gave up (its deadline passed, its caller was cancelled) keeps its place in the FIFO and its
reply, when it comes, is dropped, so the replies after it still reach their own callers. An error reply
fails only its own call. A lost connection fails what was in flight on it and is replaced in the
background by one connect attempt (never a loop of them: a call that finds no connection makes the next
attempt, and its failure is what opens the store's breaker).

Measured with 32 calls in flight, this costs a tenth of the CPU of redis-py's asyncio client per call
(docs/architecture.md, "Redis on the request path"). `cluster.py` routes the same calls over a cluster;
`store.py` picks one of the two from the URL and puts the circuit breaker in front.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
from mypy_extensions import mypyc_attr

Arg = str | bytes | int | float
STALE_S = 2.0  # silent this long while calls time out: presumed dead
SILENT_S = 0.5  # silent this long while calls time out: stalled or gone, no longer merely slow


@mypyc_attr(native_class=False)  # mypyc compiles no subclass of TimeoutError as a native class
class SlowReply(TimeoutError):
    """A reply missed its deadline on a connection that had answered within the last `SILENT_S`: the server is
    slow for a moment (busy, or on a machine short of CPU), not gone. The call fails; the store stays up."""


class ReplyError(Exception):
    """Redis answered a command with an error (`-ERR ...`, `-NOSCRIPT ...`, `-MOVED ...`)."""


class Client(Protocol):
    """What the store needs from a client: one command, or several in one round trip."""

    url: str

    async def call(self, command: Sequence[Arg]) -> Any: ...

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]: ...

    async def scan(self, match: str, each: Callable[[list[bytes]], None]) -> None: ...

    async def aclose(self) -> None: ...


# Bulk-string headers for the lengths most arguments have, made once: formatting one costs more than the rest of
# the argument's encoding (measured with callgrind: a GET and a cache SET took 27k instructions, now 18k).
BULK_HEADS = [b"$%d\r\n" % n for n in range(1024)]  # encode() compares with these sizes as literals
ARRAY_HEADS = [b"*%d\r\n" % n for n in range(16)]
# The command names and options the gateway sends, encoded whole.
WORDS = {
    word: b"$%d\r\n%b\r\n" % (len(word), word.encode())
    for word in ("GET", "SET", "PX", "EX", "NX", "DEL", "UNLINK", "EVALSHA", "EVAL", "PING", "SCRIPT", "LOAD", "INCRBY")
}


def encode(command: Sequence[Arg]) -> bytes:
    """One command as a RESP array of bulk strings, in one join: each value is copied once."""
    count = len(command)
    parts = [ARRAY_HEADS[count] if count < 16 else b"*%d\r\n" % count]
    for arg in command:
        if type(arg) is str:
            bulk = WORDS.get(arg)
            if bulk is not None:
                parts.append(bulk)
                continue
            data = arg.encode()
        elif type(arg) is bytes:
            data = arg
        elif isinstance(arg, bytes):
            data = bytes(arg)
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = repr(arg).encode()
        size = len(data)
        parts += (BULK_HEADS[size] if size < 1024 else b"$%d\r\n" % size, data, b"\r\n")
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Options:
    """How to reach and greet a server: the parts of a redis:// or rediss:// URL, plus the time limits."""

    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: ssl.SSLContext | None = None
    timeout_s: float = 0.05
    connect_timeout_s: float = 0.2
    connections: int = 2  # per node: a second one keeps a large value from holding up every small reply


def tls_context(query: dict[str, list[str]]) -> ssl.SSLContext:
    """The system's trust store, or `?ssl_ca_certs=PATH`; `?ssl_cert_reqs=none` skips verification."""
    cafile = query.get("ssl_ca_certs", [None])[0]
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"ssl_ca_certs: cannot load {cafile!r} ({exc.strerror or exc})") from None
    if query.get("ssl_cert_reqs", ["required"])[0].lower() == "none":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def address(text: str) -> tuple[str, int]:
    """`host:port`, `host` or `[v6]:port`."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = text.partition(":")
    if not (port or "6379").isdigit():
        raise ValueError(f"port {port!r} is not a number")
    return host or "127.0.0.1", int(port or 6379)


def parse_url(url: str, **limits: Any) -> tuple[list[tuple[str, int]], Options, bool]:
    """`redis[s]://[user:password@]host:port[/db]` or `redis[s]+cluster://[...@]host:port,host:port`.

    Returns the addresses (the seeds of a cluster), the options and whether the URL names a cluster.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}: use redis://, rediss:// or redis+cluster://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, password = None, None
    if userinfo:
        name, colon, secret = userinfo.partition(":")
        username, password = (unquote(name) or None, unquote(secret)) if colon else (None, unquote(name))
    addresses = [address(host) for host in hosts.split(",")] if hosts else [("127.0.0.1", 6379)]
    query = parse_qs(parts.query)
    db_text = parts.path.strip("/") or query.get("db", ["0"])[0]
    if not db_text.isdigit():
        raise ValueError(f"database {db_text!r} is not a number")
    db = int(db_text)
    tls = tls_context(query) if scheme.startswith("rediss") else None
    options = Options(username, password, db, tls, **limits)
    return addresses, options, scheme.endswith("+cluster")


def node_urls(url: str) -> list[str]:
    """Plain `redis[s]://` URLs, one per node the URL names (the seeds of a cluster), for a subscription off the
    request path (subscriber.py), where a cluster delivers a PUBLISH to the subscribers of every node."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower().removesuffix("+cluster")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    query = f"?{parts.query}" if parts.query else ""
    return [f"{scheme}://{userinfo}{at}{host.strip()}{parts.path}{query}" for host in hosts.split(",")]


class Batch:
    """Several replies awaited as one (a pipeline): settled when the last of them has arrived."""

    __slots__ = ("future", "replies", "size")

    def __init__(self, future: asyncio.Future[Any], size: int) -> None:
        self.future = future
        self.size = size
        self.replies: list[Any] = []


class Connection(asyncio.Protocol):
    """One socket: commands go out as they come, replies settle the FIFO of futures in order.

    A command on an idle connection is written at once. While replies are awaited, what the callers of one
    loop iteration send goes out in one write at the end of the iteration: a burst of requests that each
    look something up costs the socket one write, not one each. Each waiter has a deadline; one timer per
    connection, armed for the oldest, fails them in order (a deadline is a fixed time after sending, and the
    FIFO is in sending order), so a call arms no timer of its own.
    """

    def __init__(self, on_lost: Callable[[Connection], None], timeout_s: float = 0.05) -> None:
        self.reader = hiredis.Reader(replyError=ReplyError)
        self.pending: collections.deque[asyncio.Future[Any] | Batch] = collections.deque()
        self.due: collections.deque[float] = collections.deque()  # each pending waiter's deadline (loop time)
        self.expired = 0  # waiters at the front of `pending` already failed by their deadline
        self.out: list[bytes] = []  # commands to write at the end of this loop iteration
        self.transport: asyncio.Transport | None = None
        self.on_lost = on_lost
        self.timeout_s = timeout_s
        self.timer: asyncio.TimerHandle | None = None
        self.stalled_at: float | None = None  # when a call timed out with nothing read since

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass, but is one

    def send(self, data: bytes, waiter: asyncio.Future[Any] | Batch) -> None:
        out = self.out
        transport = self.transport
        if not out and not self.pending and transport is not None and not transport.is_closing():
            # Nothing in flight: no reply to wait for with others, so no reason to wait for them (as Nagle's
            # algorithm sends at once on an idle connection): at low rates a call costs no loop iteration.
            transport.write(data)
        else:
            out.append(data)
            if len(out) == 1:
                asyncio.get_running_loop().call_soon(self.flush)
        self.expect(waiter)

    def expect(self, waiter: asyncio.Future[Any] | Batch) -> None:
        """`waiter` gets the reply after those of the waiters already pending, or fails at its deadline."""
        self.pending.append(waiter)
        loop = asyncio.get_running_loop()
        due = loop.time() + self.timeout_s
        self.due.append(due)
        if self.timer is None:
            self.timer = loop.call_at(due, self.sweep)

    def flush(self) -> None:
        out = self.out
        transport = self.transport
        # An aborted socket is closing until connection_lost runs, which fails the waiters of what is dropped.
        if out and transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    def sweep(self) -> None:
        """Fail the waiters whose deadline has passed, oldest first, then wait for the next deadline."""
        self.timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        pending, due = self.pending, self.due
        while self.expired < len(pending):
            deadline = due[self.expired]
            if deadline > now:
                self.timer = loop.call_at(deadline, self.sweep)
                return
            waiter = pending[self.expired]
            self.expired += 1
            future = waiter.future if isinstance(waiter, Batch) else waiter
            if not future.done():
                future.set_exception(self.timed_out(now))

    def timed_out(self, now: float) -> TimeoutError:
        """What a call that missed its deadline fails with: slow while the server still answers, silent once it
        has answered nothing for `SILENT_S`."""
        if self.stalled_at is None:
            self.stalled_at = now
        silent = now - self.stalled_at
        if silent < SILENT_S:
            return SlowReply("redis answered late")
        if silent > STALE_S:
            # Calls have been timing out for a while and not a byte has come back: the socket is likely dead
            # without a reset (a vanished host). Drop it so that a fresh connection is tried; a merely slow
            # server keeps its connection, and its late replies are dropped in their turn.
            self.abort()
        return TimeoutError(f"redis has answered nothing for {silent:.1f} s")

    def answered(self) -> None:
        """The oldest waiter has had its reply."""
        self.pending.popleft()
        self.due.popleft()
        if self.expired:
            self.expired -= 1

    def data_received(self, data: bytes) -> None:
        self.stalled_at = None
        reader, pending = self.reader, self.pending
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError:  # not RESP: nothing after this can be matched to a call
                self.abort()
                return
            if reply is False:
                return
            if not pending:  # a reply nobody asked for: the stream cannot be trusted any more
                self.abort()
                return
            waiter = pending[0]
            if waiter.__class__ is Batch:
                assert isinstance(waiter, Batch)
                waiter.replies.append(reply)
                if len(waiter.replies) < waiter.size:
                    continue
                self.answered()
                if not waiter.future.done():
                    waiter.future.set_result(waiter.replies)
                continue
            assert isinstance(waiter, asyncio.Future)
            self.answered()
            if waiter.done():
                continue  # its caller gave up; the reply is dropped in its turn
            if reply.__class__ is ReplyError:
                waiter.set_exception(reply)
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.out.clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        while self.pending:
            waiter = self.pending.popleft()
            future = waiter.future if isinstance(waiter, Batch) else waiter
            if not future.done():
                future.set_exception(ConnectionError("redis connection lost"))
        self.due.clear()
        self.expired = 0
        self.on_lost(self)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows, on the next loop iteration


class Node:
    """One server: a few pipelined connections, (re)opened in the background one attempt at a time."""

    def __init__(self, host: str, port: int, options: Options, *, select_db: bool = True) -> None:
        self.host, self.port = host, port
        self.options = options
        self.select_db = select_db
        self.live: list[Connection] = []
        self.turn = 0
        self.filling: asyncio.Task[None] | None = None
        self.retry_at = 0.0  # after a failed connect, a node that still has a connection waits to try again
        self.closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def call(self, command: Sequence[Arg]) -> Any:
        return await self.send(encode(command), None)

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        if not commands:
            return []
        result: list[Any] = await self.send(b"".join(encode(c) for c in commands), len(commands))
        return result

    async def send(self, data: bytes, batch: int | None) -> Any:
        """Write `data` (one command, or `batch` of them) and wait, within the deadline, for the reply."""
        live = self.live
        if live and len(live) >= self.options.connections:
            self.turn = turn = (self.turn + 1) % len(live)
            connection = live[turn]
        else:
            connection = await self.connection()
        future = asyncio.get_running_loop().create_future()
        connection.send(data, future if batch is None else Batch(future, batch))
        return await future

    async def connection(self) -> Connection:
        """A live connection, waiting for the one connect attempt under way (or starting it) if need be."""
        if self.closed:
            raise ConnectionError("redis client closed")
        loop = asyncio.get_running_loop()
        if not self.live:
            try:
                await asyncio.shield(self.fill())
            except asyncio.CancelledError:
                if _cancelled():
                    raise  # this call was cancelled: its caller's business
                # The connect attempt was cancelled under this call, not the call itself: the node was closed
                # (a slot-map reload dropped it). A failed call, never a cancellation that would read as the
                # caller's own (a request cut as if the gateway were shutting down).
                raise ConnectionError(f"redis node {self.address} closed while connecting") from None
            except Exception:
                if not self.live:  # else the first connection is up and only a later one failed
                    raise
        elif loop.time() >= self.retry_at:
            self.fill()
        if not self.live:
            raise ConnectionError(f"no connection to redis at {self.address}")
        self.turn = (self.turn + 1) % len(self.live)
        return self.live[self.turn]

    def fill(self) -> asyncio.Task[None]:
        if self.filling is None or self.filling.done():
            self.filling = asyncio.get_running_loop().create_task(self._fill())
            self.filling.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: may be unawaited
        return self.filling

    async def _fill(self) -> None:
        # One attempt a missing connection, never a loop until the pool is full: a server that closes what it
        # accepts (going down, or at its client limit) would have kept this opening connections for good, and
        # the call waiting on it waiting with it.
        loop = asyncio.get_running_loop()
        for _ in range(self.options.connections - len(self.live)):
            if self.closed:
                return
            try:
                connection = await asyncio.wait_for(self.open(), self.options.connect_timeout_s)
            except BaseException:
                self.retry_at = loop.time() + 1.0
                raise
            if self.closed:
                connection.abort()
                return
            if connection.transport is None:
                # Lost before it was counted live, so `lost` could not take it out: never live, a failed connect.
                self.retry_at = loop.time() + 1.0
                raise ConnectionError(f"redis at {self.address} closed the connection as it opened")
            self.live.append(connection)

    async def open(self) -> Connection:
        """Connect, then AUTH and SELECT in one round trip, before any call may use the connection."""
        loop = asyncio.get_running_loop()
        options = self.options
        _, connection = await loop.create_connection(
            lambda: Connection(self.lost, options.timeout_s),
            self.host,
            self.port,
            ssl=options.tls,
            server_hostname=self.host if options.tls is not None else None,
        )
        greeting: list[Sequence[Arg]] = []
        if options.password is not None:
            auth = ("AUTH", options.username, options.password) if options.username else ("AUTH", options.password)
            greeting.append(auth)
        if options.db and self.select_db:
            greeting.append(("SELECT", options.db))
        if greeting:
            future = loop.create_future()
            connection.send(b"".join(encode(c) for c in greeting), Batch(future, len(greeting)))
            try:
                for reply in await future:
                    if isinstance(reply, ReplyError):
                        raise reply
            except BaseException:
                connection.abort()
                raise
        return connection

    def lost(self, connection: Connection) -> None:
        if connection in self.live:
            self.live.remove(connection)
            now = asyncio.get_running_loop().time()
            if not self.closed and now >= self.retry_at:
                # One attempt, in the background; its failure waits for the next call. At most one a second:
                # connections lost as soon as they open must not become a reconnect storm.
                self.retry_at = now + 1.0
                self.fill()

    def close(self) -> None:
        self.closed = True
        if self.filling is not None and not self.filling.done():
            self.filling.cancel()
        for connection in list(self.live):
            connection.abort()
        self.live.clear()


def _cancelled() -> bool:
    """Whether the running task itself is being cancelled (rather than something it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Redis:
    """A single Redis server (redis:// or rediss://)."""

    def __init__(self, url: str, address: tuple[str, int], options: Options) -> None:
        self.url = url
        self.node = Node(*address, options)

    def call(self, command: Sequence[Arg]) -> Coroutine[Any, Any, Any]:
        return self.node.send(encode(command), None)  # the node's coroutine itself: no frame of our own

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        return await self.node.pipeline(commands)

    async def scan(self, match: str, each: Callable[[list[bytes]], None]) -> None:
        await scan(self.node, match, each)

    async def aclose(self) -> None:
        self.node.close()


SCAN_COUNT = 1000  # keys a SCAN step looks at: a step takes Redis well under a millisecond


async def scan(node: Node, match: str, each: Callable[[list[bytes]], None]) -> None:
    """`each` batch of the keys matching `match` on `node`, a SCAN step at a time: a key there from the first
    step to the last is seen at least once; one added or removed meanwhile may or may not be."""
    cursor: Arg = 0
    while True:
        reply = await node.call(("SCAN", cursor, "MATCH", match, "COUNT", SCAN_COUNT))
        cursor, keys = reply
        if keys:
            each(keys)
        if cursor == b"0":
            return
