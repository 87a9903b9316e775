"""A backend's gate: its capacity, the gateway's requests in flight to it, and the queues of those waiting.

Up to `capacity` requests go through at once (`max_in_flight` per endpoint in service). Beyond it a request
waits here, in the queue of its class; a slot that frees goes to the highest class with someone waiting and,
within a class, to the tenants in weighted round robin (a tenant of weight w takes up to w turns in a row,
then the next tenant's turn comes), so one tenant's burst cannot starve the others of its class. A waiter is
a future resolved by the request that frees the slot: nothing polls.

The predicted time to first token of a request that would queue is the wait (the requests ahead of it, in its
class and above, over the service rate: capacity / the mean time a slot is held) plus the mean TTFT measured
once served. Both means are exponentially weighted over the last few dozen requests.

`reserved` slots (per endpoint) are kept for the highest class: the others pass only while fewer than
`capacity - reserved` are in flight, so that a top-class request finds a slot at once instead of waiting for
the next one to free (a backend without preemption cannot make room any faster).

A backend whose engine preempts by priority (`engine_preempts`) lets a top-class request through at once even
when the gate is full, up to `capacity` such requests past the limit: the engine makes room by pausing a
running request of a lower class, which the gateway cannot do without breaking that request's answer.

The capacity is `max_in_flight` per endpoint in service, or what the engines report (`capacity: auto`,
capacity.py), which `read` holds: read from the engines off the request path, used here as a number.

Unloaded, a request costs one comparison and an increment going in and a decrement going out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.context import Exchange

ALPHA = 0.05  # weight of a new sample in the moving means: about the last 40 requests


class Waiter:
    __slots__ = ("future", "tenant")

    def __init__(self, future: asyncio.Future[None], tenant: str) -> None:
        self.future = future
        self.tenant = tenant


class Fair:
    """One class's waiters: a queue per tenant, served in weighted round robin."""

    __slots__ = ("count", "ring", "tenants", "turns", "weight")

    def __init__(self, weight: Callable[[str], int]) -> None:
        self.weight = weight
        self.tenants: dict[str, deque[Waiter]] = {}
        self.ring: deque[str] = deque()  # tenants with someone waiting; the head's turn now
        self.turns = 0  # turns the head tenant has had in a row
        self.count = 0

    def push(self, waiter: Waiter) -> None:
        queue = self.tenants.get(waiter.tenant)
        if queue is None:
            queue = self.tenants[waiter.tenant] = deque()
            self.ring.append(waiter.tenant)
        queue.append(waiter)
        self.count += 1

    def pop(self) -> Waiter:
        tenant = self.ring[0]
        queue = self.tenants[tenant]
        waiter = queue.popleft()
        self.count -= 1
        self.turns += 1
        if not queue:
            del self.tenants[tenant]
            self.ring.popleft()
            self.turns = 0
        elif self.turns >= self.weight(tenant):
            self.ring.rotate(-1)
            self.turns = 0
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """A waiter that gave up (its client left, or it waited too long); False if it was no longer here."""
        queue = self.tenants.get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        self.count -= 1
        if not queue:
            del self.tenants[waiter.tenant]
            if self.ring[0] == waiter.tenant:
                self.turns = 0
            self.ring.remove(waiter.tenant)
        return True


AT = "admission.at"  # ex.state: the endpoint a top-class request is counted at


class Tops:
    """Top-class requests in flight per endpoint label, counted from the moment one is sent there
    (`ex.route_bias`: the weight least_outstanding compares before load)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def __call__(self, endpoint: str) -> int:
        return self.count.get(endpoint, 0)

    def sent(self, ex: Exchange, endpoint: str) -> None:
        count = self.count
        before = ex.state.get(AT)
        if before is not None:
            count[before] -= 1  # the endpoint before failed: counted at the next one instead
        count[endpoint] = count.get(endpoint, 0) + 1
        ex.state[AT] = endpoint

    def ended(self, ex: Exchange) -> None:
        endpoint = ex.state.pop(AT, None)
        if endpoint is not None:
            self.count[endpoint] -= 1


class Full(Exception):
    """The gate's queue is at `max_queue`."""


class Gate:
    """One backend's admission: `enter` or `wait`, then `leave` exactly once per request let through."""

    def __init__(
        self,
        backend: str,
        per_endpoint: int,
        endpoints: Callable[[], int],
        classes: int,
        weight: Callable[[str], int],
        max_queue: int,
        reserved: int = 0,
        preempts: bool = False,
    ) -> None:
        self.backend = backend
        self.per_endpoint = per_endpoint
        self.reserved_per_endpoint = reserved
        self.endpoints = endpoints  # endpoints in service now (replicas come and go)
        self.capacity = 0
        self.limits: list[int] = []  # by rank: the in-flight count below which a request of that class passes
        self.inflight = 0
        self.waiting = 0
        self.preempts = preempts  # the engine preempts a lower priority: the top class may pass a full gate
        self.over = 0  # top-class requests in flight that passed the full gate (the engine made room)
        self.read: int | None = None  # the capacity the engines report (capacity: auto), None: configured
        # With `preempts`: per endpoint, top-class requests in flight there, which its engine cannot pause for
        # another: least_outstanding sends a top-class request where there are fewest.
        self.bias = Tops()
        self.max_queue = max_queue
        self.queues = [Fair(weight) for _ in range(classes)]  # by rank, 0 the highest
        self._size()
        self.hold_s = 0.0  # mean time a slot is held; 0 until a request has left
        self.ttft_s = 0.0  # mean time to first token once through (upstream), 0 until measured

    def _size(self) -> None:
        count = max(1, self.endpoints())
        self.capacity = self.per_endpoint * count if self.read is None else max(1, self.read)
        shared = max(1, self.capacity - self.reserved_per_endpoint * count)
        self.limits = [self.capacity] + [shared] * (len(self.queues) - 1)

    def enter(self, rank: int = 0) -> bool:
        """Take a slot now if one is free for the class and nobody waits for it (the unloaded path)."""
        if self.inflight < self.limits[rank] and not self.waiting:
            self.inflight += 1
            return True
        return False

    def past(self, rank: int) -> bool:
        """A top-class request through a full gate, when the engine preempts a lower class to make room."""
        if rank or not self.preempts or self.over >= self.capacity:
            return False
        self.inflight += 1
        self.over += 1
        return True

    def resize(self, read: int | None) -> None:
        """The capacity the engines report now (None: the configured one); waiters take any room it makes."""
        self.read = read
        self._size()
        if self.waiting:
            self._hand_over()

    def ahead(self, rank: int) -> int:
        """Requests that would be served before a new one of class `rank`."""
        return sum(q.count for q in self.queues[: rank + 1])

    def predicted_s(self, rank: int) -> float:
        """Predicted time to first token of a request of class `rank` queued now; 0 before any measure."""
        if self.hold_s <= 0.0:
            return 0.0
        return (self.ahead(rank) + 1) * self.hold_s / self.limits[rank] + self.ttft_s

    async def wait(self, tenant: str, rank: int) -> None:
        """Queue until a slot is handed over. Cancelled (the client left, a timeout), the place is given up;
        a slot handed over at that very moment goes on to the next waiter."""
        if self.waiting >= self.max_queue:
            raise Full
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = Waiter(future, tenant)
        queue = self.queues[rank]
        queue.push(waiter)
        self.waiting += 1
        # A top-class request may find a reserved slot free while lower classes wait for a shared one.
        self._hand_over()
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.leave_now()  # it was given the slot as it gave up: pass it on
            elif queue.remove(waiter):  # still queued (else a hand-over found it cancelled and counted it)
                self.waiting -= 1
            raise

    def leave(self, held_s: float, ttft_s: float | None, over: bool = False) -> None:
        """A request let through has ended after holding its slot `held_s`; its TTFT, when it had one; `over`:
        it had passed the full gate (`past`)."""
        self.hold_s = held_s if self.hold_s <= 0.0 else self.hold_s + ALPHA * (held_s - self.hold_s)
        if ttft_s is not None:
            self.ttft_s = ttft_s if self.ttft_s <= 0.0 else self.ttft_s + ALPHA * (ttft_s - self.ttft_s)
        # leave_now, written out: every request let through ends here (a call fewer a request, interpreted).
        self.inflight -= 1
        if over:
            self.over -= 1
        if self.waiting:
            self._size()
            self._hand_over()

    def leave_now(self, over: bool = False) -> None:
        self.inflight -= 1
        if over:
            self.over -= 1
        if self.waiting:
            self._size()
            self._hand_over()

    def _hand_over(self) -> None:
        limits = self.limits
        while self.waiting:
            rank = next((r for r, q in enumerate(self.queues) if q.count), -1)
            if rank < 0:  # pragma: no cover - `waiting` counts the queues' waiters
                return
            queue = self.queues[rank]
            if self.inflight >= limits[rank]:
                return  # the classes below it have the same limit: none of them may pass either
            waiter = queue.pop()
            self.waiting -= 1
            if waiter.future.done():  # cancelled, its task not yet run to give up its place
                continue
            self.inflight += 1  # counted as in flight before it wakes: nobody can take its slot meanwhile
            waiter.future.set_result(None)
