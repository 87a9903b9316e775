"""The cache's in-process level: least recently used first out, bounded in entries and in bytes.

An OrderedDict with each hit moved to the end: the first key is the least recently used one, and a store
evicts from the front until both bounds hold, each step O(1). (A plain dict would do the same in insertion
order, but finding its first key after many deletions from the front scans the deleted slots.) Expired
entries are dropped when looked up and otherwise leave in their turn; until then they count against the
bounds like any other, so memory stays within `max_bytes` whatever the traffic. cachetools' TLRUCache,
used before, keeps a heap of expiry times and expires entries on every access and on `len()`: several
times the cost per store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def size(self) -> int: ...  # the bytes it holds, as accounted

    @property
    def expires(self) -> float: ...  # wall-clock seconds


V = TypeVar("V", bound=Sized)


class L1(Generic[V]):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, V] = OrderedDict()
        self.sizes: dict[str, int] = {}  # as accounted when stored: an entry may grow later (see put)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> V | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if entry.expires <= time.time():
            self.pop(key)
            return None
        self.entries.move_to_end(key)  # now the most recently used
        return entry

    def put(self, key: str, entry: V) -> None:
        """Store, or store again an entry that has grown (a replay made): its size is counted anew."""
        size = entry.size
        if self.max_entries <= 0 or size > self.max_bytes:
            self.pop(key)
            return
        old = self.sizes.pop(key, None)
        if old is not None:
            self.bytes -= old
            del self.entries[key]
        entries, sizes = self.entries, self.sizes
        while entries and (len(entries) >= self.max_entries or self.bytes + size > self.max_bytes):
            oldest, _ = entries.popitem(last=False)
            self.bytes -= sizes.pop(oldest)
        entries[key] = entry
        sizes[key] = size
        self.bytes += size

    def pop(self, key: str) -> None:
        if self.entries.pop(key, None) is not None:
            self.bytes -= self.sizes.pop(key)

    def values(self) -> list[V]:
        return list(self.entries.values())
