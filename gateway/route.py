"""Route policies: which of a backend's endpoints serves a request (`routing:` in the backend's config).

A policy is asked twice per request: `key(ex)` once (what it needs of the request: a session id, the prompt's
block hashes), then `pick(key, endpoints, now)` for each endpoint tried, from the endpoints in service; after a
response head `served(key, endpoint, now)` lets it remember where the request went.

- round_robin: in turn.
- least_outstanding: the power of two choices: two endpoints at random, the less loaded one.
- session: rendezvous hashing of a session id (a header, else the body's `user`): a session sticks to one
  endpoint, and when endpoints come or go only the sessions of those endpoints move.
- prefix: the endpoint that has recently been sent most of this request's leading prompt, as long as it is
  not overloaded: a weighted score (llm-d's scorer, in spirit) within a bounded-load cap (consistent hashing
  with bounded loads). docs/architecture.md says why both, and what a pick costs.

Load is what `Endpoint.load` says: requests this process has in flight there, or the server's own count of
waiting and running requests when its vLLM metrics are fresh and higher.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import TYPE_CHECKING, Any, ClassVar, Protocol
from zlib import crc32

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.replica import Endpoint
    from gateway.settings import RoutingSettings


class Policy(Protocol):
    name: ClassVar[str]

    def key(self, ex: Exchange) -> Any:
        """What the policy needs of the request, computed once however many endpoints are tried."""
        ...

    def pick(self, key: Any, endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        """One of `endpoints` (never empty) and its score, for the span."""
        ...

    def served(self, key: Any, endpoint: Endpoint, now: float) -> None:
        """`endpoint` answered the request: remember it if the policy learns from that."""
        ...


class RoundRobin:
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def key(self, ex: Exchange) -> None:
        return None

    def pick(self, key: Any, endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        self.turn += 1
        return endpoints[self.turn % len(endpoints)], 0.0

    def served(self, key: Any, endpoint: Endpoint, now: float) -> None:
        return None


class LeastOutstanding:
    name: ClassVar[str] = "least_outstanding"

    def __init__(self, fresh_s: float) -> None:
        self.fresh_s = fresh_s

    def key(self, ex: Exchange) -> None:
        return None

    def pick(self, key: Any, endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        return two_choices(endpoints, now, self.fresh_s)

    def served(self, key: Any, endpoint: Endpoint, now: float) -> None:
        return None


class Session:
    name: ClassVar[str] = "session"

    def __init__(self, header: str, fresh_s: float) -> None:
        self.header = header.encode()
        self.fresh_s = fresh_s

    def key(self, ex: Exchange) -> bytes | None:
        value = ex.header(self.header)
        if value is None:
            user = ex.json.get("user")
            value = user.encode() if isinstance(user, str) and user else None
        return value

    def pick(self, key: bytes | None, endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        if key is None:  # no session: nothing to stick to
            return two_choices(endpoints, now, self.fresh_s)
        best = endpoints[0]
        top = -1
        for endpoint in endpoints:
            # Deterministic across processes and restarts (Python's hash() is salted per process).
            weight = int.from_bytes(hashlib.blake2b(key + endpoint.label.encode(), digest_size=8).digest())
            if weight > top:
                best, top = endpoint, weight
        return best, top / 2.0**64

    def served(self, key: Any, endpoint: Endpoint, now: float) -> None:
        return None


class Prefix:
    name: ClassVar[str] = "prefix"

    def __init__(self, spec: RoutingSettings, fresh_s: float) -> None:
        self.block = spec.block_chars
        self.max_blocks = spec.max_blocks
        self.limit = spec.block_chars * spec.max_blocks
        self.capacity = spec.cache_blocks
        self.ttl = spec.cache_ttl_s
        self.load_weight = spec.load_weight
        self.kv_weight = spec.kv_weight
        self.factor = spec.max_load_factor
        self.fresh_s = fresh_s
        self.turn = 0

    def key(self, ex: Exchange) -> list[int]:
        return prompt_blocks(ex.json, self.block, self.limit, self.max_blocks)

    def pick(self, key: list[int], endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        count = len(endpoints)
        if count == 1:
            return endpoints[0], 0.0
        fresh_s = self.fresh_s
        loads = [endpoint.load(now, fresh_s) for endpoint in endpoints]
        # Bounded loads: an endpoint may take this request only while it stays within `factor` times the mean.
        cap = math.ceil(self.factor * (sum(loads) + 1.0) / count)
        scale = self.load_weight / (max(loads) + 1.0)
        blocks = len(key)
        ttl = self.ttl
        self.turn += 1
        start = self.turn % count  # equal scores (a new prompt, idle endpoints) go round in turn
        best: Endpoint | None = None
        best_score = -math.inf
        for offset in range(count):
            index = (start + offset) % count
            load = loads[index]
            if load + 1.0 > cap:
                continue
            endpoint = endpoints[index]
            score = -scale * load
            if blocks:
                # The longest prefix of `key` sent here recently. What is remembered is prefix-closed (a
                # block is touched after every block behind it, at the same time), so a binary search finds it.
                seen = endpoint.seen
                low, high = 0, blocks
                while low < high:
                    middle = (low + high + 1) // 2
                    sent = seen.get(key[middle - 1])
                    if sent is not None and now - sent <= ttl:
                        low = middle
                    else:
                        high = middle - 1
                score += low / blocks
            if now - endpoint.scraped_at <= fresh_s:  # the server's KV-cache usage, when it is known
                score -= self.kv_weight * endpoint.kv
            if score > best_score:
                best, best_score = endpoint, score
        if best is None:  # cannot happen (the least loaded is within the cap), but never fail a pick
            best = min(endpoints, key=lambda endpoint: endpoint.load(now, fresh_s))
        return best, best_score

    def served(self, key: list[int], endpoint: Endpoint, now: float) -> None:
        seen = endpoint.seen
        touch = seen.move_to_end
        for block in reversed(key):  # the head last: evicted last, as a server's prefix cache frees blocks
            seen[block] = now
            touch(block)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


def two_choices(endpoints: list[Endpoint], now: float, fresh_s: float) -> tuple[Endpoint, float]:
    """The power of two choices: nearly the least loaded, without herding every request onto it."""
    count = len(endpoints)
    if count == 1:
        return endpoints[0], 0.0
    first = random.randrange(count)
    second = random.randrange(count - 1)
    if second >= first:
        second += 1
    a, b = endpoints[first], endpoints[second]
    load_a, load_b = a.load(now, fresh_s), b.load(now, fresh_s)
    return (a, load_a) if load_a <= load_b else (b, load_b)


def prompt_blocks(body: dict[str, Any], block: int, limit: int, max_blocks: int) -> list[int]:
    """Chained hashes of the leading prompt's full blocks of `block` bytes (UTF-8), at most `max_blocks`.

    The messages are taken in order (role and text), so a conversation's next turn begins with the same
    blocks as the turn before. A block's hash is the CRC-32 of the whole prompt up to its end, computed
    incrementally (`crc32(block, previous)`), so equal hashes mean equal prefixes. Only the first `limit`
    characters are looked at. CRC-32 is the cheapest chained hash at hand, about three times cheaper per
    block here than blake2b (docs/architecture.md); its 32 bits are plenty for a routing hint, where a rare
    false match costs one less well placed request, never a wrong answer.
    """
    parts: list[str] = []
    size = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
            elif not isinstance(content, str):
                content = ""
            role = message.get("role")
            parts.append(role if isinstance(role, str) else "")
            if size + len(content) >= limit:  # the rest is never hashed: do not copy it
                parts.append(content[: limit - size])
                break
            parts.append(content)
            size += len(content) + 8
        text = "\x1e".join(parts)
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else ""
    data = memoryview(text.encode())
    count = min(len(data) // block, max_blocks)
    running = crc32(str(body.get("model")).encode())
    hashes = []
    for start in range(0, count * block, block):
        running = crc32(data[start : start + block], running)  # CRC-32 of everything up to this block's end
        hashes.append(running)
    return hashes


def build(spec: RoutingSettings, fresh_s: float) -> Policy:
    if spec.policy == "least_outstanding":
        return LeastOutstanding(fresh_s)
    if spec.policy == "session":
        return Session(spec.session_header, fresh_s)
    if spec.policy == "prefix":
        return Prefix(spec, fresh_s)
    return RoundRobin()
