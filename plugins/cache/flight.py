"""One upstream call in progress that identical requests may follow (its replay to a follower, an async
generator, which mypyc does not compile, is replay.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugins.cache.exact import Entry


class Flight:
    """One upstream call in progress that identical requests may follow."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.chunks: list[bytes] = []
        self.followers = 0
        self.done = False  # the leader's answer ended, well or badly
        self.entry: Entry | None = None  # set when it ended well and was stored
        self.failed = False
        # Made only when someone waits: most flights are followed by nobody.
        self._changed: asyncio.Future[None] | None = None

    def feed(self, chunk: bytes) -> None:
        if chunk:
            self.chunks.append(chunk)
            self._wake()

    def finish(self, entry: Entry | None, failed: bool) -> None:
        self.done, self.entry, self.failed = True, entry, failed
        self._wake()

    def _wake(self) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            if not changed.done():
                changed.set_result(None)

    def waiter(self) -> asyncio.Future[None]:
        """What the next chunk or the end resolves; made only when someone waits."""
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    async def changed(self, timeout: float) -> bool:
        """Wait for the next chunk or the end; False on timeout."""
        try:
            await asyncio.wait_for(asyncio.shield(self.waiter()), timeout)
        except TimeoutError:
            return False
        return True
