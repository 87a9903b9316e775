"""Route policies: which of a backend's endpoints serves a request (`routing:` in the backend's config).

A policy is asked twice per request: `key(ex)` once (what it needs of the request: a session id, the prompt's
block hashes), then `pick(key, endpoints, now)` for each endpoint tried, from the endpoints in service; after a
response head `served(key, endpoint, now)` lets it remember where the request went.

- round_robin: in turn.
- least_outstanding: the power of two choices: two endpoints at random, the less loaded one.
- session: rendezvous hashing of a session id (a header, else the body's `user`): a session sticks to one
  endpoint, and when endpoints come or go only the sessions of those endpoints move.
- prefix: the endpoint that has recently been sent most of this request's leading prompt, less what its load
  costs: a weighted score in blocks of prompt (llm-d's scorers, in spirit) within a bounded-load cap
  (consistent hashing with bounded loads). docs/architecture.md says why both, and what a pick costs.

Load is what `Endpoint.load` says: requests this process has in flight there, plus those other gateways
had sent it when its vLLM metrics are fresh.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_right
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from gateway.context import Exchange
    from gateway.replica import Endpoint
    from gateway.settings import RoutingSettings


ROLE_AND_CONTENT = itemgetter("role", "content")


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


# A prompt's key: the chained hashes of its blocks (ending at `block_ends`), the turn marks to look up (offset,
# hash), and the hash of the whole prompt, which the endpoint that serves it remembers (0: too long to hash).
Blocks = tuple[list[int], list[tuple[int, int]], int]


class Prefix:
    """The endpoint that holds most of the request's leading prompt, less what its load costs, within a bound.

    One index for all endpoints: hash -> a bit mask of the endpoints that were recently sent that prefix.
    What an endpoint remembers is prefix-closed (a prompt's blocks are touched last to first), so the masks
    shrink along a prompt's blocks and a few binary searches give every endpoint's match; the turn marks
    then say whether it holds the previous turn whole. Each endpoint's own LRU (`Endpoint.seen`,
    `cache_blocks`, with a TTL) says what it forgets.
    """

    name: ClassVar[str] = "prefix"

    def __init__(self, spec: RoutingSettings, fresh_s: float) -> None:
        self.ends = block_ends(spec.block_chars, spec.max_blocks)
        self.per_block = 1.0 / spec.block_chars
        self.capacity = spec.cache_blocks
        self.ttl = spec.cache_ttl_s
        self.load_weight = spec.load_weight
        self.kv_weight = spec.kv_weight
        self.factor = spec.max_load_factor
        self.fresh_s = fresh_s
        self.turn = 0
        self.where: dict[int, int] = {}  # prefix hash -> bits of the endpoints that hold it
        self.members: dict[int, Endpoint] = {}  # bit -> endpoint, for those that were sent something
        self.everyone = 0  # their bits
        self.offered: dict[int, float] = {}  # bit -> when the endpoint was last among those to pick from
        self.free: list[int] = []  # bits of endpoints forgotten, for the next new ones
        self.next_bit = 1
        self.next_sweep = 0.0

    def key(self, ex: Exchange) -> Blocks:
        return prompt_blocks(ex.json, self.ends)

    def pick(self, key: Blocks, endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        count = len(endpoints)
        if count == 1:
            return endpoints[0], 0.0
        if now >= self.next_sweep:
            self._sweep(endpoints, now)
        groups = self._matches(key) if key[0] else ()
        self.turn += 1
        start = self.turn % count  # equal scores (a new prompt, idle endpoints) go round in turn
        order = endpoints[start:] + endpoints[:start]
        fresh_after = now - self.fresh_s
        load_weight = self.load_weight
        kv_weight = self.kv_weight
        loads: list[float] = []
        scores = []
        for endpoint in order:  # one pass, so `Endpoint.load` is inlined
            pool = endpoint.pool
            load: float = pool.busy if pool is not None else 0
            score = 0.0
            if endpoint.scraped_at >= fresh_after:  # the server's metrics: what others sent, KV-cache usage
                load += endpoint.others
                score = -kv_weight * endpoint.kv
            bit = endpoint.bit
            for mask, held in groups:
                if bit & mask:
                    score += held
                    break
            loads.append(load)
            # In blocks: the prompt it holds (prefill saved), less `load_weight` blocks per request it has.
            scores.append(score - load_weight * load)
        # Bounded loads: an endpoint may take this request only while it stays within `factor` times the mean.
        cap = math.ceil(self.factor * (sum(loads) + 1.0) / count) - 1.0
        if max(loads) > cap:  # (the least loaded never is)
            for index, load in enumerate(loads):
                if load > cap:
                    scores[index] = -math.inf
        best = max(scores)
        return order[scores.index(best)], best

    def _matches(self, key: Blocks) -> list[tuple[int, float]]:
        """(endpoints' bits, blocks of the prompt they hold), longest first; endpoints not named hold none."""
        hashes, marks, _ = key
        rest = self.everyone
        where = self.where
        ends = self.ends
        per_block = self.per_block
        groups = []
        high = len(hashes)
        while rest and high and where.get(hashes[0], 0) & rest:
            # The deepest block any of `rest` holds; those holding it match that far, the others less far.
            low = 1
            while low < high:
                middle = (low + high + 1) // 2
                if where.get(hashes[middle - 1], 0) & rest:
                    low = middle
                else:
                    high = middle - 1
            mask = where.get(hashes[low - 1], 0) & rest
            rest &= ~mask
            high = low - 1
            # A turn mark past its last block, short of the next one: those holding it hold that much more.
            reach = ends[low] if low < len(hashes) else 1 << 62
            for offset, mark in reversed(marks):  # the deepest first
                if ends[low - 1] < offset < reach:
                    whole = where.get(mark, 0) & mask
                    if whole:
                        groups.append((whole, offset * per_block))
                        mask &= ~whole
            if mask:
                groups.append((mask, ends[low - 1] * per_block))
        return groups

    def served(self, key: Blocks, endpoint: Endpoint, now: float) -> None:
        hashes, _, whole = key
        if not hashes:
            return
        bit = endpoint.bit or self._join(endpoint, now)
        where = self.where
        seen = endpoint.seen
        touch = seen.move_to_end
        # The whole prompt first and its head last: evicted last, as a server's prefix cache frees blocks.
        for block in (whole, *reversed(hashes)) if whole else reversed(hashes):
            if block in seen:
                seen[block] = now
                touch(block)
            else:
                seen[block] = now
                where[block] = where.get(block, 0) | bit
        over = len(seen) - self.capacity
        while over > 0:
            self._drop(seen.popitem(last=False)[0], bit)
            over -= 1

    def _join(self, endpoint: Endpoint, now: float) -> int:
        bit = self.free.pop() if self.free else self.next_bit
        if bit == self.next_bit:
            self.next_bit <<= 1
        endpoint.bit = bit
        self.members[bit] = endpoint
        self.everyone |= bit
        self.offered[bit] = now
        return bit

    def _drop(self, block: int, bit: int) -> None:
        mask = self.where.get(block, 0) & ~bit
        if mask:
            self.where[block] = mask
        else:
            self.where.pop(block, None)

    def _sweep(self, endpoints: list[Endpoint], now: float) -> None:
        """Forget blocks not sent for `cache_ttl_s`, and endpoints not offered for as long (gone from the backend)."""
        ttl = self.ttl
        self.next_sweep = now + ttl / 16.0
        for endpoint in endpoints:
            if endpoint.bit:
                self.offered[endpoint.bit] = now
        for bit, member in list(self.members.items()):
            seen = member.seen
            if now - self.offered[bit] > ttl:
                for block in seen:
                    self._drop(block, bit)
                seen.clear()
                member.bit = 0
                del self.members[bit], self.offered[bit]
                self.everyone &= ~bit
                self.free.append(bit)
                continue
            while seen:
                block, sent = next(iter(seen.items()))
                if now - sent <= ttl:
                    break
                del seen[block]
                self._drop(block, bit)


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


def block_ends(block: int, max_blocks: int) -> list[int]:
    """Where the hashed blocks of a prompt end: every `block` characters up to four, then each block half as
    long again as the one before (rounded to `block`), up to `max_blocks * block` in all.

    The deeper into a prompt, the less a block's worth of difference matters to which endpoint holds more
    of it, and the fewer blocks the cheaper a pick: 16 KiB is 10 blocks rather than 32. A conversation's
    turns are found whole anyway, by their marks (`prompt_blocks`).
    """
    ends: list[int] = []
    limit = block * max_blocks
    end = 0
    while end < limit:
        step = block if len(ends) < 4 else max(block, end // 2 // block * block)
        end = min(end + step, limit)
        ends.append(end)
    return ends


def prompt_blocks(body: dict[str, Any], ends: list[int]) -> Blocks:
    """The key of a request's leading prompt: its blocks' chained hashes, its turn marks, its whole hash.

    The messages are taken in order (role and text), so a conversation's next turn begins with the same
    blocks as the turn before. A block's hash is Python's hash of (the previous block's hash, its text): the
    whole prompt up to its end, so equal hashes mean equal prefixes (but for a 64-bit collision, which costs
    one less well placed request, never a wrong answer). Python's string hash (SipHash, salted per process)
    runs in C over the text as it is, with no encoding; what the endpoints were sent is remembered only by
    this process, so the salt does no harm.

    Blocks end at fixed places, turns do not: the whole prompt's hash is remembered too, and a request looks
    up, besides its blocks, the prompt its last assistant message answered (the previous turn, whole) and its
    own whole prompt. A mark's hash is that of (the last block's hash before it, the text from there), so it
    does not depend on where other turns ended. Only the first `ends[-1]` characters are looked at.
    """
    limit = ends[-1]
    answered = 0  # where the prompt that the last assistant message answered ends
    messages = body.get("messages")
    if isinstance(messages, list):
        text, answered = _chat_text(messages, limit)
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else ""
    length = len(text)
    model = body.get("model")
    seed = running = hash(model) if isinstance(model, str) else 0
    hashes = []
    start = 0
    for end in ends[: bisect_right(ends, length)]:
        running = hash((running, text[start:end]))
        hashes.append(running)
        start = end
    whole = hash((running, text[start:])) if length <= limit else 0
    marks = []
    if 0 < answered <= limit:
        index = bisect_right(ends, answered) - 1 if answered >= ends[0] else -1
        base, at = (hashes[index], ends[index]) if index >= 0 else (seed, 0)
        marks.append((answered, hash((base, text[at:answered]))))
    if whole:
        marks.append((length, whole))
    return hashes, marks, whole


def _chat_text(messages: list[Any], limit: int) -> tuple[str, int]:
    """The messages' roles and texts joined by a separator, and where the last assistant message's prompt ends.

    Messages of string roles and contents take one comprehension and one join in C (a huge prompt is copied
    once, nothing next to its prefill); anything else (content arrays, a missing role) takes the walk, which
    stops copying at `limit`.
    """
    try:
        parts = list(chain.from_iterable(map(ROLE_AND_CONTENT, messages)))
        text = "\x1e".join(parts)  # TypeError unless every part is a string
    except (KeyError, TypeError):
        pass
    else:
        answered = 0
        tail = 0  # the parts after the message looked at, and their separators
        for index in range(len(parts) - 2, 1, -2):  # the last assistant message: near the end
            tail += len(parts[index]) + len(parts[index + 1]) + 2
            if parts[index] == "assistant":
                answered = len(text) - tail
                break
        return text, answered
    parts = []
    append = parts.append
    size = 0  # of the text so far, with a separator after each part
    answered = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = message.get("content")
        if not isinstance(content, str):
            content = _text(content)
        if not isinstance(role, str):
            role = ""
        elif role == "assistant":
            answered = size - 1
        append(role)
        append(content)
        size += len(role) + len(content) + 2
        if size >= limit:  # the rest is never hashed: do not copy it
            break
    return "\x1e".join(parts), answered


def _text(content: Any) -> str:
    """The text parts of a message's content array, joined; anything else has none."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def build(spec: RoutingSettings, fresh_s: float) -> Policy:
    if spec.policy == "least_outstanding":
        return LeastOutstanding(fresh_s)
    if spec.policy == "session":
        return Session(spec.session_header, fresh_s)
    if spec.policy == "prefix":
        return Prefix(spec, fresh_s)
    return RoundRobin()
