"""What every semantic store keeps and answers: entries by partition, searched by cosine similarity.

An entry is one complete answer: the text it answered (the guards compare it with the query), its unit vector,
the answer's JSON as it would go to a client that did not stream, the model that served it, and its times.
A store is searched within one exact partition, (tenant, model, partition hash), and never outside it: the
partition is a filter, not a score. Vectors are unit length (the embedder normalises them), so the cosine
similarity is a dot product.

Stores fail open: a store that is slow or down raises `StoreDown`, which the plugin counts as a miss; a write
that cannot be made is dropped (and counted), never retried on the request path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field

from gateway.settings import Strict

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    Vector = NDArray[np.float32]
else:
    Vector = Any


class StoreSection(Strict):
    """`semantic_cache.store`"""

    type: Literal["memory", "pgvector"] = "memory"
    max_entries: int = Field(10000, ge=0)  # memory: over all partitions, oldest out first
    max_bytes: int = Field(64 * 1024 * 1024, ge=0)  # memory: answers, texts and vectors
    max_partition_entries: int = Field(2000, ge=1)  # memory: per partition, which bounds one search's work
    dsn: str = ""  # pgvector: postgresql://user:password@host:5432/db
    table: str = "sluice_semantic_cache"  # pgvector: tables <table>_<dimensions>
    pool_size: int = Field(4, ge=1)
    timeout_s: float = Field(1.0, gt=0)  # pgvector: per statement
    retry_s: float = Field(2.0, gt=0)  # pgvector: after a failure, lookups miss at once for this long
    cleanup_s: float = Field(60.0, gt=0)  # pgvector: expired rows deleted this often


class StoreDown(Exception):
    """The store did not answer (down, slow, refused): the lookup is a miss."""


@dataclass(frozen=True, slots=True)
class Where:
    """The exact partition an entry belongs to."""

    tenant: str
    model: str
    partition: str


@dataclass(slots=True)
class Entry:
    where: Where
    text: str  # what was embedded: the guards compare it with the query's
    endpoint: str
    served: str  # the model that produced the answer
    answer: bytes  # the answer's JSON (the non-stream form); a streamed hit is replayed from it
    created: float  # wall-clock seconds
    expires: float
    ident: str = ""  # the store's id for it, shown on a hit (span, access log)
    vector: Vector | None = field(default=None, repr=False)
    # The guards' profile of `text` (guards.Profile), made when it is stored, so that a lookup profiles only the
    # query (an in-process entry keeps it; one read from PostgreSQL is profiled when a lookup meets it).
    profile: Any = field(default=None, repr=False)

    @property
    def age_s(self) -> float:
        return max(time.time() - self.created, 0.0)

    @property
    def size(self) -> int:
        """Bytes it holds in memory, roughly: its answer, text and vector, plus its guard profile and bookkeeping."""
        vector = 0 if self.vector is None else int(self.vector.nbytes)
        return len(self.answer) + len(self.text) * 6 + vector + 1000


@dataclass(frozen=True, slots=True)
class Candidate:
    entry: Entry
    similarity: float


class Store(Protocol):
    kind: str

    async def start(self) -> None: ...

    async def search(self, where: Where, vector: Vector, k: int) -> list[Candidate]:
        """Up to `k` live entries of the partition, most similar first; raises StoreDown."""
        ...

    async def add(self, entry: Entry) -> None:
        """Keep `entry` (its vector set); raises StoreDown, or drops it when the store is full."""
        ...

    async def purge(self, tenant: str, model: str | None) -> int:
        """Remove a tenant's entries (of one model); how many."""
        ...

    async def close(self) -> None: ...


def make(settings: StoreSection) -> Store:
    """The configured store. Its module is imported only now: numpy and asyncpg load only when it is used."""
    if settings.type == "pgvector":
        from plugins.semantic_cache.pgvector import PgvectorStore

        return PgvectorStore(
            settings.dsn, settings.table, settings.pool_size, settings.timeout_s, settings.retry_s, settings.cleanup_s
        )
    from plugins.semantic_cache.memory import MemoryStore

    return MemoryStore(settings.max_entries, settings.max_bytes, settings.max_partition_entries)
