"""Encoded spans on their way to the collector: a bounded queue and the one thread that sends it in batches.

With the lean OTLP encoder the gateway needs neither the SDK's span objects nor its BatchSpanProcessor: a
trace is encoded where it is laid out (gateway/telemetry/spans.py), after its response has ended, and only bytes
wait here. The processor takes a lock, reads the pid and checks the queue once per span; the export thread
encoded every span while holding the GIL the event loop needs, in bursts of a whole batch. Here the loop
appends one trace's bytes at a time, and the thread only joins them and waits on the network, which
releases the GIL. The batching is the SDK's, with its settings: OTEL_BSP_SCHEDULE_DELAY (ms between
exports), OTEL_BSP_MAX_EXPORT_BATCH_SIZE and OTEL_BSP_MAX_QUEUE_SIZE (spans).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

SpanCounter = Callable[[str, int], None]
Send = Callable[[Sequence[bytes]], None]  # one batch of encoded spans to the collector; it counts how it went


class SpanQueue:
    def __init__(self, send: Send, count: SpanCounter, *, capacity: int, batch: int, delay_s: float) -> None:
        self.send = send
        self.count = count
        self.capacity = capacity
        self.batch = batch
        self.delay_s = delay_s
        self.queue: collections.deque[bytes] = collections.deque()  # appended by the loop, taken by the thread
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="sluice-span-export", daemon=True)
        self.thread.start()

    def room(self, spans: int) -> bool:
        """Whether a trace of `spans` fits whole; one that does not is counted as dropped, never half sent."""
        if len(self.queue) + spans > self.capacity:
            self.count("dropped", spans)
            return False
        return True

    def put(self, spans: Sequence[bytes]) -> None:
        queue = self.queue
        queue.extend(spans)
        if len(queue) >= self.batch and not self.wake.is_set():
            self.wake.set()

    def _run(self) -> None:
        while not self.stopping:
            self.wake.wait(self.delay_s)
            self.wake.clear()
            self._export(whole=False)
        self._export(whole=True)

    def _export(self, whole: bool) -> None:
        """A batch, and more while a whole batch is waiting (or, at the end, while anything is)."""
        queue = self.queue
        while queue:
            taken = [queue.popleft() for _ in range(min(self.batch, len(queue)))]
            self.send(taken)
            if not whole and len(queue) < self.batch:
                return

    def flush(self) -> None:
        """Send everything queued now, from the calling thread (the export thread may take part of it)."""
        self._export(whole=True)

    def close(self, timeout_s: float) -> bool:
        """Send what is queued and stop, waiting at most `timeout_s`; False if the collector held it up."""
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()
