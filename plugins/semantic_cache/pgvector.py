"""The shared store (`store: {type: pgvector, dsn: ...}`): PostgreSQL with pgvector, through asyncpg.

Every gateway pointed at the same database sees every entry. One table per embedding dimension,
`<table>_<dimensions>` (e.g. `sluice_semantic_cache_384`), made on first use from the dimension of the
embedding model's first answer, so that the vector column is typed and the HNSW index (cosine distance,
`vector_cosine_ops`) can be built. Beside it a b-tree on (tenant, model, partition): a search is

    SELECT ... WHERE tenant = $1 AND model = $2 AND partition = $3 AND expires > $5
    ORDER BY embedding <=> $4 LIMIT $6

so the partition is a filter and never a score. For a small partition the planner takes the b-tree and sorts
exactly; for a large one the HNSW index, with pgvector's iterative scan (`hnsw.iterative_scan`, 0.8+) so that
the filter does not starve the result. Entries carry their expiry: a search never returns an expired one, and
each gateway deletes expired rows every `cleanup_s`.

Failing open: every statement has `timeout_s`; a connection failure or a timeout marks the store down for
`retry_s`, during which lookups are misses at once and writes are dropped, and the next request after it tries
again. A database that is down at start-up does not stop the gateway: the connection is retried in the
background. Vectors go over the wire in pgvector's binary form (a dimension count, then big-endian float32s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import struct
import time
from typing import Any

import asyncpg
import numpy as np

from plugins.semantic_cache.store import Candidate, Entry, StoreDown, Vector, Where

log = logging.getLogger("sluice.semantic_cache")

DOWN = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.CannotConnectNowError)
IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")


def encode_vector(vector: Vector) -> bytes:
    return struct.pack(">HH", len(vector), 0) + np.asarray(vector, dtype=">f4").tobytes()


def decode_vector(data: bytes) -> Vector:
    dimensions = struct.unpack_from(">H", data)[0]
    out: Vector = np.frombuffer(data, dtype=">f4", count=dimensions, offset=4).astype(np.float32)
    return out


async def _init(connection: Any) -> None:
    await connection.set_type_codec(
        "vector", schema="public", encoder=encode_vector, decoder=decode_vector, format="binary"
    )


class PgvectorStore:
    kind = "pgvector"

    def __init__(self, dsn: str, table: str, pool_size: int, timeout_s: float, retry_s: float, cleanup_s: float):
        if not IDENTIFIER.match(table):
            raise ValueError(f"table {table!r}: lower-case letters, digits and _ only")
        self.dsn = dsn
        self.table = table
        self.pool_size = pool_size
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.cleanup_s = cleanup_s
        self.pool: Any = None
        self.down_until = 0.0
        self.error = ""
        self.tables: set[int] = set()  # dimensions whose table is known to exist
        self._making = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle

    async def start(self) -> None:
        try:
            await self._connect()
        except Exception as exc:
            log.warning("semantic cache: PostgreSQL unreachable at start-up (%s); lookups miss until it is", exc)
            self._down(exc)
            self._spawn(self._reconnect())
        self._spawn(self._cleanup())

    async def _connect(self) -> None:
        first = await asyncio.wait_for(asyncpg.connect(self.dsn), self.timeout_s * 5)
        try:
            await first.execute("CREATE EXTENSION IF NOT EXISTS vector")
        finally:
            await first.close()
        self.pool = await asyncio.wait_for(
            asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=self.pool_size,
                init=_init,
                server_settings={"hnsw.iterative_scan": "relaxed_order"},
            ),
            self.timeout_s * 5,
        )
        self.down_until = 0.0

    async def _reconnect(self) -> None:
        while self.pool is None:
            await asyncio.sleep(self.retry_s)
            try:
                await self._connect()
                log.info("semantic cache: PostgreSQL reachable again")
            except Exception as exc:
                self._down(exc)

    async def _cleanup(self) -> None:
        while True:
            await asyncio.sleep(self.cleanup_s)
            for dimensions in list(self.tables):
                with contextlib.suppress(StoreDown):
                    await self._run("execute", f"DELETE FROM {self._name(dimensions)} WHERE expires <= $1", time.time())

    def _spawn(self, job: Any) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.pool.close(), 2.0)

    # -- the statements

    def _name(self, dimensions: int) -> str:
        return f"{self.table}_{dimensions}"

    def _down(self, exc: BaseException) -> None:
        if not self.down_until:
            log.warning("semantic cache: PostgreSQL failed (%s); lookups miss for %g s", exc or type(exc), self.retry_s)
        self.error = str(exc) or type(exc).__name__
        self.down_until = time.monotonic() + self.retry_s

    async def _run(self, method: str, query: str, *args: Any) -> Any:
        if self.pool is None or (self.down_until and time.monotonic() < self.down_until):
            raise StoreDown(self.error or "not connected")
        try:
            async with self.pool.acquire(timeout=self.timeout_s) as connection:
                result = await getattr(connection, method)(query, *args, timeout=self.timeout_s)
        except DOWN as exc:
            self._down(exc)
            raise StoreDown(str(exc) or type(exc).__name__) from None
        except asyncpg.PostgresError as exc:
            raise StoreDown(f"{type(exc).__name__}: {exc}") from None
        if self.down_until:
            self.down_until = 0.0
            log.info("semantic cache: PostgreSQL answers again")
        return result

    async def _ensure(self, dimensions: int) -> str:
        name = self._name(dimensions)
        if dimensions in self.tables:
            return name
        async with self._making:
            if dimensions not in self.tables:
                # Two gateways may start at once: the advisory lock makes one of them create, the other wait.
                await self._run(
                    "execute",
                    f"""
                    DO $$ BEGIN
                      PERFORM pg_advisory_xact_lock(hashtext('{name}'));
                      CREATE TABLE IF NOT EXISTS {name} (
                        id bigserial PRIMARY KEY,
                        tenant text NOT NULL, model text NOT NULL, partition text NOT NULL,
                        embedding vector({dimensions}) NOT NULL,
                        query text NOT NULL, endpoint text NOT NULL, served text NOT NULL, answer bytea NOT NULL,
                        created double precision NOT NULL, expires double precision NOT NULL);
                      CREATE INDEX IF NOT EXISTS {name}_where ON {name} (tenant, model, partition);
                      CREATE INDEX IF NOT EXISTS {name}_expires ON {name} (expires);
                      CREATE INDEX IF NOT EXISTS {name}_hnsw ON {name} USING hnsw (embedding vector_cosine_ops);
                    END $$""",
                )
                self.tables.add(dimensions)
        return name

    async def search(self, where: Where, vector: Vector, k: int) -> list[Candidate]:
        name = await self._ensure(len(vector))
        rows = await self._run(
            "fetch",
            f"SELECT id, query, endpoint, served, answer, created, expires, embedding <=> $4 AS distance FROM {name} "
            "WHERE tenant = $1 AND model = $2 AND partition = $3 AND expires > $5 "
            "ORDER BY embedding <=> $4 LIMIT $6",
            where.tenant,
            where.model,
            where.partition,
            vector,
            time.time(),
            k,
        )
        found = [
            Candidate(
                Entry(
                    where,
                    r["query"],
                    r["endpoint"],
                    r["served"],
                    r["answer"],
                    r["created"],
                    r["expires"],
                    f"pg{r['id']}",
                ),
                1.0 - float(r["distance"]),
            )
            for r in rows
        ]
        found.sort(key=lambda c: -c.similarity)  # an iterative index scan may return them slightly out of order
        return found

    async def add(self, entry: Entry) -> None:
        assert entry.vector is not None
        name = await self._ensure(len(entry.vector))
        ident = await self._run(
            "fetchval",
            f"INSERT INTO {name} (tenant, model, partition, embedding, query, endpoint, served, answer, created, "
            "expires) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING id",
            entry.where.tenant,
            entry.where.model,
            entry.where.partition,
            entry.vector,
            entry.text,
            entry.endpoint,
            entry.served,
            entry.answer,
            entry.created,
            entry.expires,
        )
        entry.ident = f"pg{ident}"

    async def purge(self, tenant: str, model: str | None) -> int:
        tables = await self._run(
            "fetch", "SELECT tablename FROM pg_tables WHERE tablename ~ $1", f"^{self.table}_[0-9]+$"
        )
        removed = 0
        for row in tables:
            name = row["tablename"]
            if model is None:
                status = await self._run("execute", f"DELETE FROM {name} WHERE tenant = $1", tenant)
            else:
                status = await self._run(
                    "execute", f"DELETE FROM {name} WHERE tenant = $1 AND model = $2", tenant, model
                )
            removed += int(status.rsplit(" ", 1)[-1])
        return removed


async def purge(dsn: str, table: str, tenant: str, model: str | None, timeout_s: float) -> int:
    """Delete a tenant's entries (of one model) from every dimension's table, over one connection."""
    connection = await asyncio.wait_for(asyncpg.connect(dsn), timeout_s * 5)
    try:
        names = await connection.fetch("SELECT tablename FROM pg_tables WHERE tablename ~ $1", f"^{table}_[0-9]+$")
        removed = 0
        for row in names:
            name = row["tablename"]
            if model is None:
                status = await connection.execute(f"DELETE FROM {name} WHERE tenant = $1", tenant)
            else:
                status = await connection.execute(f"DELETE FROM {name} WHERE tenant = $1 AND model = $2", tenant, model)
            removed += int(status.rsplit(" ", 1)[-1])
        return removed
    finally:
        await connection.close()
