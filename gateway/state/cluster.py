"""Redis Cluster over the lean client: each command goes to the master that owns its key's hash slot.

The slot map comes from `CLUSTER SLOTS`, asked of a known master or else a seed from the URL; each
master gets one `Node` (a few pipelined connections, as for a single server). A `MOVED` reply means
the map is stale: the slot is pointed at the new owner at once, the whole map is reloaded in the
background and the command is sent again, once, to the new owner; a node that a reload drops while a call
waits on it fails that call (a `ConnectionError`, never a cancellation of the caller), which is sent once to
the owner the reload found. An `ASK` reply (a slot being
migrated) sends `ASKING` and the command to the named node, without touching the map. A node that
cannot be reached also reloads the map in the background, so that a replica promoted in its place is
found without restarting anything. Keys that must meet in one script or one slot share a `{hash tag}`
(docs/architecture.md, "Redis on the request path").
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Callable, Sequence
from typing import Any

from gateway.state.resp import Arg, Node, Options, ReplyError, address, scan

SLOTS = 16384
SCRIPTED = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})  # key at 3 if numkeys
KEYLESS = frozenset({"PING", "ECHO", "INFO", "TIME", "PUBLISH", "CLUSTER", "CLIENT", "CONFIG", "COMMAND", "DBSIZE"})
BROADCAST = frozenset({"SCRIPT", "FLUSHALL", "FLUSHDB"})  # every master must see these
REFRESH_INTERVAL_S = 0.1  # at most this often, however many calls notice a stale map at once
REROUTES = 2  # a call whose node a reload dropped is sent again this many times at most


def slot(key: Arg) -> int:
    """CRC16 (XMODEM, as `binascii.crc_hqx`) of the key, or of its `{hash tag}` when it has a non-empty one."""
    data = key if isinstance(key, bytes) else str(key).encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % SLOTS


def name_of(command: Sequence[Arg]) -> str:
    head = command[0]
    return (head.decode() if isinstance(head, bytes) else str(head)).upper()


def key_of(command: Sequence[Arg]) -> Arg | None:
    """The key a command is routed by: its first, or a script's first; None for keyless commands."""
    name = name_of(command)
    if name in SCRIPTED:
        return command[3] if len(command) > 3 and int(command[2]) > 0 else None
    if name in KEYLESS or name in BROADCAST or len(command) < 2:
        return None
    return command[1]


class Cluster:
    """A Redis Cluster (redis+cluster:// or rediss+cluster://), found from its seed nodes."""

    def __init__(self, url: str, seeds: list[tuple[str, int]], options: Options) -> None:
        self.url = url
        self.seeds = seeds
        self.options = options
        self.nodes: dict[tuple[str, int], Node] = {}
        self.slots: list[Node | None] = [None] * SLOTS
        self.masters: list[Node] = []
        self.turn = 0
        self.refreshing: asyncio.Task[None] | None = None
        self.refreshed_at = float("-inf")

    def node(self, host: str, port: int) -> Node:
        node = self.nodes.get((host, port))
        if node is None:
            # A cluster has only database 0: SELECT is never sent, whatever the URL says.
            node = self.nodes[(host, port)] = Node(host, port, self.options, select_db=False)
        return node

    async def call(self, command: Sequence[Arg]) -> Any:
        if not self.masters:
            await self.loaded()
        key = key_of(command)
        if key is None:
            if name_of(command) in BROADCAST:
                replies = await asyncio.gather(*(m.call(command) for m in self.masters), return_exceptions=True)
                for reply in replies:
                    if isinstance(reply, BaseException):
                        raise reply
                return replies[0]
            self.turn = (self.turn + 1) % len(self.masters)
            return await self.send(self.masters[self.turn], command)
        return await self.send(self.owner(key), command)

    def owner(self, key: Arg) -> Node:
        node = self.slots[slot(key)]
        if node is None:
            self.refresh_soon()
            raise ConnectionError(f"hash slot {slot(key)} is not served by any known node")
        return node

    async def send(self, node: Node, command: Sequence[Arg], *, redirected: bool = False, rerouted: int = 0) -> Any:
        try:
            return await node.call(command)
        except ReplyError as exc:
            target = None if redirected else self.redirect(exc, node)
            if target is None:
                raise
            return await self.follow(exc, target, command)
        except OSError:  # refused, reset, timed out: the node may be gone and the map stale
            self.refresh_soon()
            if node.closed and rerouted < REROUTES:
                # A slot-map reload dropped the node while this call waited on it (a MOVED target that a reload
                # answered by a node not yet aware of the failover, or an old master that the next reload
                # dropped): sent again to the owner the map now names, which may redirect it once more.
                key = key_of(command)
                owner = self.slots[slot(key)] if key is not None else None
                if owner is not None and owner is not node and not owner.closed:
                    return await self.send(owner, command, rerouted=rerouted + 1)
            raise

    async def follow(self, exc: ReplyError, target: Node, command: Sequence[Arg]) -> Any:
        """Send `command` again where a MOVED or ASK reply pointed (once: a second redirect is an error)."""
        if str(exc).startswith("ASK "):
            _asking, reply = await target.pipeline([("ASKING",), command])
            if isinstance(reply, ReplyError):
                raise reply
            return reply
        return await self.send(target, command, redirected=True)

    def redirect(self, exc: ReplyError, node: Node) -> Node | None:
        """The node named by a MOVED or ASK reply; a MOVED slot is pointed there at once."""
        kind, _, rest = str(exc).partition(" ")
        if kind not in ("MOVED", "ASK"):
            return None
        number, _, where = rest.partition(" ")
        host, port = address(where)
        target = self.node(host if where.rpartition(":")[0] else node.host, port)  # ":port" means the same host
        if kind == "MOVED":
            self.slots[int(number)] = target
            if target not in self.masters:
                self.masters.append(target)
            self.refresh_soon()
        return target

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Commands grouped by owner (`SCRIPT LOAD` and the like to every master), one round trip per node in
        parallel; redirects are followed one by one."""
        if not self.masters:
            await self.loaded()
        groups: dict[Node, list[int]] = {}
        for index, command in enumerate(commands):
            key = key_of(command)
            if key is None and name_of(command) in BROADCAST:  # to every master, as `call` sends it
                for master in self.masters:
                    groups.setdefault(master, []).append(index)
                continue
            node = self.owner(key) if key is not None else self.masters[0]
            groups.setdefault(node, []).append(index)
        results: list[Any] = [None] * len(commands)
        batches = await asyncio.gather(
            *(node.pipeline([commands[i] for i in indices]) for node, indices in groups.items()),
            return_exceptions=True,
        )
        for (node, indices), replies in zip(groups.items(), batches, strict=True):
            if isinstance(replies, BaseException):
                if isinstance(replies, OSError):
                    self.refresh_soon()
                raise replies
            for index, reply in zip(indices, replies, strict=True):
                target = self.redirect(reply, node) if isinstance(reply, ReplyError) else None
                if target is not None:
                    try:
                        reply = await self.follow(reply, target, commands[index])
                    except ReplyError as exc:
                        reply = exc
                if not isinstance(results[index], ReplyError):  # a broadcast's answer: the first error, if any
                    results[index] = reply
        return results

    async def scan(self, match: str, each: Callable[[list[bytes]], None]) -> None:
        """Every master's keys that match: a master that fails over meanwhile fails the scan (ConnectionError),
        since its replica's keys were never looked at."""
        if not self.masters:
            await self.loaded()
        masters = list(self.masters)
        for master in masters:
            await scan(master, match, each)
        if self.masters != masters:
            raise ConnectionError("the cluster's masters changed during the scan")

    async def loaded(self) -> None:
        """Wait for the first slot map (shared by every call that arrives before it)."""
        if self.refreshing is None or self.refreshing.done():
            self.refresh_soon(force=True)
        assert self.refreshing is not None
        try:
            await asyncio.shield(self.refreshing)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise ConnectionError("the Redis Cluster client was closed while loading its slot map") from None
        if not self.masters:
            raise ConnectionError("no Redis Cluster node answered CLUSTER SLOTS")

    def refresh_soon(self, *, force: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if self.refreshing is not None and not self.refreshing.done():
            return
        if not force and loop.time() - self.refreshed_at < REFRESH_INTERVAL_S:
            return
        self.refreshed_at = loop.time()
        self.refreshing = loop.create_task(self.refresh())
        self.refreshing.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: may be unawaited

    async def refresh(self) -> None:
        """Load the slot map from the first node that answers: a known master, else a seed."""
        candidates = [*self.masters, *(self.node(*seed) for seed in self.seeds)]
        last: Exception = ConnectionError("no Redis Cluster seed nodes")
        for candidate in dict.fromkeys(candidates):
            try:
                ranges = await candidate.call(("CLUSTER", "SLOTS"))
            except (OSError, ReplyError) as exc:
                last = exc
                continue
            if isinstance(ranges, list) and ranges:
                self.apply(ranges, candidate)
                return
        raise last

    def apply(self, ranges: list[Any], answered: Node) -> None:
        slots: list[Node | None] = [None] * SLOTS
        masters: dict[Node, None] = {}
        for start, end, master, *_replicas in ranges:
            host = master[0].decode() if master[0] else answered.host  # empty: the node we asked
            node = self.node(host, int(master[1]))
            masters[node] = None
            slots[start : end + 1] = [node] * (end - start + 1)
        self.slots, self.masters = slots, list(masters)
        for key, node in list(self.nodes.items()):
            if node not in masters:  # a failed or demoted master, or a seed that is a replica
                del self.nodes[key]
                node.close()

    async def aclose(self) -> None:
        if self.refreshing is not None and not self.refreshing.done():
            self.refreshing.cancel()
        for node in list(self.nodes.values()):
            node.close()
        self.nodes.clear()
