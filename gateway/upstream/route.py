"""Route policies: which of a backend's endpoints serves a request (`routing:` in the backend's config).

A policy is asked twice per request: `key(ex)` once (what it needs of the request: a session id, the prompt's
block hashes), then `pick(key, endpoints, now)` for each endpoint tried, from the endpoints in service; after a
response head `served(key, endpoint, now)` lets it remember where the request went.

- round_robin: in turn.
- least_outstanding: the power of two choices: two endpoints at random, the less loaded one; where a plugin
  set `ex.route_bias`, the one with the lower bias first, then the less loaded (the admission plugin: a
  top-class request goes where the fewest requests run that the engine cannot preempt for it).
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
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from gateway.upstream.prefix import Blocks, block_ends, prompt_blocks

if TYPE_CHECKING:
    from gateway.context import Exchange, RouteBias
    from gateway.settings import RoutingSettings
    from gateway.upstream.replica import Endpoint


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

    def key(self, ex: Exchange) -> RouteBias | None:
        return ex.route_bias

    def pick(self, key: RouteBias | None, endpoints: list[Endpoint], now: float) -> tuple[Endpoint, float]:
        return two_choices(endpoints, now, self.fresh_s, key)

    def served(self, key: Any, endpoint: Endpoint, now: float) -> None:
        return None


# Headers in which agent clients send their session's id, recognised after the configured `session_header`:
# Claude Code's, the `session_id` OpenAI's Codex clients send on their WebSocket handshake, and the generic one
# (the default `session_header`, also looked at when another is configured).
AGENT_SESSION_HEADERS = (b"x-claude-code-session-id", b"session_id", b"x-session-id")


class Session:
    name: ClassVar[str] = "session"

    def __init__(self, header: str, fresh_s: float) -> None:
        self.header = header.encode()
        self.fresh_s = fresh_s

    def key(self, ex: Exchange) -> bytes | None:
        value = ex.header(self.header)
        if value is None:
            for header in AGENT_SESSION_HEADERS:  # agent clients name their sessions themselves
                value = ex.header(header)
                if value is not None:
                    return value
            # The Responses and chat APIs' `prompt_cache_key` names what should meet the same cache (the Codex CLI
            # sends its conversation's id there, and no session header): the same affinity a session asks for.
            user = ex.json.get("prompt_cache_key") or ex.json.get("user")
            if user is None:  # Anthropic's Messages API: metadata.user_id (Claude Code's holds its session)
                metadata = ex.json.get("metadata")
                user = metadata.get("user_id") if isinstance(metadata, dict) else None
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


def two_choices(
    endpoints: list[Endpoint], now: float, fresh_s: float, bias: RouteBias | None = None
) -> tuple[Endpoint, float]:
    """The power of two choices: nearly the least loaded, without herding every request onto it; with `bias`,
    the lower bias of the two first."""
    count = len(endpoints)
    if count == 1:
        return endpoints[0], 0.0
    first = random.randrange(count)
    second = random.randrange(count - 1)
    if second >= first:
        second += 1
    a, b = endpoints[first], endpoints[second]
    load_a, load_b = a.load(now, fresh_s), b.load(now, fresh_s)
    if bias is not None:
        bias_a, bias_b = bias(a.label), bias(b.label)
        if bias_a != bias_b:
            return (a, load_a) if bias_a < bias_b else (b, load_b)
    return (a, load_a) if load_a <= load_b else (b, load_b)


def build(spec: RoutingSettings, fresh_s: float) -> Policy:
    if spec.policy == "least_outstanding":
        return LeastOutstanding(fresh_s)
    if spec.policy == "session":
        return Session(spec.session_header, fresh_s)
    if spec.policy == "prefix":
        return Prefix(spec, fresh_s)
    return RoundRobin()
