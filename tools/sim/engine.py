"""The replica model every stand-in runs: continuous batching, a FIFO queue and a prefix cache, as vLLM has.

What it models, per replica (see docs/simulator.md for the figures behind the defaults):

- a batch of at most `max_batch` running requests; the rest wait and are admitted as running ones finish or
  their clients leave, by the request's `priority` (lower first, as vLLM's `--scheduling-policy priority`
  does; 0 when the body has none), then in arrival order;
- with `preemption` (`sluice sim --priority-preemption`), a request that finds the batch full takes the slot
  of the running request of the lowest priority, when that one's priority is strictly lower than its own. The
  one preempted stops between two tokens (its stream pauses, nothing is lost or repeated), waits again with its
  place (priority, arrival), and once let back in recomputes its prefix (`ttft_ms`) before its next token.
  This is what engines that preempt by priority do: vLLM's V0 scheduler under `--scheduling-policy priority`
  (vllm/core/scheduler.py, `_schedule_priority_preemption`: while the waiting head cannot be scheduled and the
  lowest running one ranks below it, preempt that one by recompute and put it back in the waiting queue), and
  SGLang with `--enable-priority-scheduling` (schedule_policy.py, `preempt_to_schedule`: the lowest-priority
  running request gives way when the difference exceeds `--priority-scheduling-preemption-threshold`; the one
  preempted goes back to waiting and is recomputed from the radix cache). Without it (the default) the model is
  vLLM's V1 engine, the only engine of current vLLM: its scheduler (vllm/v1/core/sched/scheduler.py) admits a
  waiting request only while `len(self.running) < max_num_running_reqs` and never preempts for a batch slot; its
  priority preemption (`max(self.running, key=lambda r: (r.priority, r.arrival_time))`) happens only when a
  running request cannot get a KV block, which this model does not reach (see below);
- a prefix cache: the prompt (`chat_tokens`) is cut into blocks of `block_tokens` tokens, each block's hash
  chained to the previous one's, so a conversation's next turn shares its leading blocks with the turn before.
  The cache is an LRU of `cache_blocks` block hashes, a prompt's tail evicted before its head. As in vLLM,
  a hit never covers the whole prompt: at least the last token is computed, so the lookup stops one token
  short. Generated tokens are cached too, as vLLM caches every block once it is full: when a request has
  generated its answer, the blocks of the prompt followed by the answer (as the next turn's chat template
  writes it: the assistant's framing, its text, its end) are stored, but for the last token, whose KV is never
  computed. A conversation's next turn, which repeats the answer, finds it cached;
- time to first token: `ttft_ms` plus `prefill_ms_per_token` for each prompt token the cache did not hold;
- time per output token: `tpot_ms * (1 + batch_slowdown * (running - 1))`, read again at every token, so a
  request slows down while others join its batch and speeds up as they leave.

Not modelled: chunked prefill slowing the decode of others, preemption when KV blocks run out, blocks held
by running requests being safe from eviction (the LRU may evict them).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.simulation.answers import Profile, chat_tokens, simulate
from tools.sim.httpd import Handler, Response, json_response

LIKES = ("vllm", "tgi", "llamacpp", "ollama")
# Requests running at once unless told: Ollama runs one at a time (OLLAMA_NUM_PARALLEL defaults to 1).
BATCH = {"vllm": 8, "tgi": 8, "llamacpp": 8, "ollama": 1}
# Prefix-cache granularity unless told, (block_tokens, cache_blocks): vLLM's 16-token blocks; llama.cpp reuses a
# cached prompt token by token (its slot's common prefix), so one token a block, the same 16,384 tokens in all.
CACHE = {"vllm": (16, 1024), "tgi": (16, 1024), "llamacpp": (1, 16384), "ollama": (16, 1024)}


@dataclass(frozen=True, slots=True)
class Options:
    """How a fleet of stand-in replicas behaves (`sluice sim --like/--replicas` flags)."""

    like: str = "vllm"
    model: str = "sim"
    profile: Profile = field(default_factory=Profile)  # ttft_ms is the prefill base, tpot_ms one lone decode step
    max_batch: int = 8
    cache_blocks: int = 1024
    block_tokens: int = 16
    prefill_ms_per_token: float = 0.2
    batch_slowdown: float = 0.1
    load_ms: float = 0.0
    idle_unload_s: float = 300.0
    max_model_len: int = 4096
    server_version: str = ""  # the release stood in for (TGI's stream shape follows it); empty: the stand-in's own
    preemption: bool = False  # a waiting request preempts a running one of strictly lower priority (see above)


@dataclass(slots=True)
class Stats:
    """What reached a replica, for tests of the gateway (`GET /_sim/stats`)."""

    paths: Counter[str] = field(default_factory=Counter)
    loads: int = 0
    unloads: int = 0
    warmups: int = 0  # requests that only load a model (Ollama's empty prompt) or ask for one token at most


@dataclass(slots=True)
class Replica:
    """One stand-in replica: what answers, its engine, and how long it keeps its port closed at start."""

    handler: Handler
    engine: Engine
    listen_after_s: float = 0.0


class Engine:
    """The batch, queue and prefix cache of one replica."""

    def __init__(self, options: Options, replica: int) -> None:
        self.options = options
        self.replica = replica
        self.stats = Stats()
        self.running = 0
        self.waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap: (priority, arrival, turn)
        self.arrivals = 0
        self.batch: dict[Generation, tuple[int, int]] = {}  # the running generations: (priority, arrival)
        self.preemptions = 0
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.kv_blocks = 0  # blocks held by running requests, for the cache-usage gauge
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which were cached
        self.evictions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0

    def generation(self, tokens: list[str], count: int, priority: int = 0) -> Generation:
        return Generation(self, tokens, count, priority)

    def hashes(self, tokens: list[str], known: list[bytes] | None = None) -> list[bytes]:
        """The chained hash of every full block of `tokens`; `known`: those of its first blocks, already hashed."""
        size = self.options.block_tokens
        out = list(known or ())
        chain = out[-1] if out else b""
        for start in range(len(out) * size, len(tokens) - size + 1, size):
            chain = hashlib.blake2b(chain + "\0".join(tokens[start : start + size]).encode(), digest_size=16).digest()
            out.append(chain)
        return out

    def usage_ratio(self) -> float:
        return min(1.0, self.kv_blocks / max(1, self.options.cache_blocks))

    def snapshot(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "replica": self.replica,
            "like": self.options.like,
            "requests": dict(stats.paths),
            "loads": stats.loads,
            "unloads": stats.unloads,
            "warmups": stats.warmups,
            "running": self.running,
            "waiting": len(self.waiting),
            "preemptions": self.preemptions,
            "finished": self.finished,
            "cached_blocks": len(self.blocks),
            "evictions": self.evictions,
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
        }

    # Batch and queue

    async def admit(self, priority: int = 0, holder: Generation | None = None) -> None:
        """Wait for a batch slot. `holder`, the generation that will hold it, may be preempted (with
        `preemption`)."""
        self.arrivals += 1
        arrival = self.arrivals
        if holder is not None:
            holder.arrival = arrival
        if self.running < self.options.max_batch and not self.waiting:
            self.running += 1
        elif not (self.options.preemption and holder is not None and self._preempt(priority)):
            await self.wait(self.queue(priority, arrival))
        # else the victim's slot passed over: `running` is unchanged
        if holder is not None:
            self.batch[holder] = (priority, arrival)

    def queue(self, priority: int, arrival: int) -> tuple[int, int, asyncio.Future[None]]:
        entry = (priority, arrival, asyncio.get_running_loop().create_future())
        heapq.heappush(self.waiting, entry)
        return entry

    async def wait(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        turn = entry[2]
        try:
            await turn  # `release` counts us as running before it wakes us
        except asyncio.CancelledError:
            if entry in self.waiting:
                self.waiting.remove(entry)
                heapq.heapify(self.waiting)
            elif turn.done() and not turn.cancelled():
                self.release()
            raise

    def _preempt(self, priority: int) -> bool:
        """Take the slot of the running generation of the lowest priority (the latest to arrive among equals)
        if its priority is strictly lower (a higher value) than `priority`; it waits again at once, in its
        old place (counted in `vllm:num_requests_waiting`, as vLLM counts a preempted request)."""
        if not self.batch:
            return False
        victim, (worst, arrival) = max(self.batch.items(), key=lambda item: item[1])
        if worst <= priority:
            return False
        del self.batch[victim]
        victim.resumed = self.queue(worst, arrival)
        self.preemptions += 1
        return True

    def release(self, holder: Generation | None = None) -> None:
        if holder is not None:
            self.batch.pop(holder, None)
        self.running -= 1
        while self.waiting and self.running < self.options.max_batch:
            _, _, turn = heapq.heappop(self.waiting)
            if not turn.done():
                self.running += 1
                turn.set_result(None)

    # Prefix cache

    def lookup(self, tokens: list[str]) -> tuple[int, list[bytes]]:
        """Cached prompt tokens for `tokens` (counted as vLLM does), then cache all of its full blocks; and
        the blocks' hashes, which the answer's blocks chain on."""
        size = self.options.block_tokens
        hashes = self.hashes(tokens)
        hit = 0
        for digest in hashes[: (len(tokens) - 1) // size]:  # the last token is always computed
            if digest not in self.blocks:
                break
            self.blocks.move_to_end(digest)
            hit += 1
        self.store(hashes)
        cached = hit * size
        self.queries += len(tokens)
        self.hits += cached
        self.prompt_tokens += len(tokens)
        return cached, hashes

    def store(self, hashes: list[bytes]) -> None:
        # Touched last block first, so the LRU gives up a prompt's tail before its head (vLLM frees a
        # request's blocks in reverse order for the same reason): a shorter shared prefix keeps hitting.
        for digest in reversed(hashes):
            self.blocks[digest] = None
            self.blocks.move_to_end(digest)
        while len(self.blocks) > self.options.cache_blocks:
            self.blocks.popitem(last=False)
            self.evictions += 1


class Generation:
    """One request's way through a replica: `async with` waits for a batch slot and holds it until the end."""

    def __init__(self, engine: Engine, tokens: list[str], count: int, priority: int = 0) -> None:
        self.engine = engine
        self.priority = priority
        self.tokens = tokens
        self.count = count
        self.cached = 0
        self.blocks: list[bytes] = []  # the prompt's block hashes
        self.kv_blocks = math.ceil((len(tokens) + count) / engine.options.block_tokens)
        # Preempted: its slot was taken by a request of a higher priority; its place in the queue for another.
        self.resumed: tuple[int, int, asyncio.Future[None]] | None = None
        self.holding = False  # counted in the engine's `running`
        self.arrival = 0  # its place in the engine's queue, kept when it is preempted

    async def __aenter__(self) -> Generation:
        engine = self.engine
        await engine.admit(self.priority, self)
        self.holding = True
        self.cached, self.blocks = engine.lookup(self.tokens)
        engine.kv_blocks += self.kv_blocks
        return self

    async def __aexit__(self, *exc: object) -> None:
        engine = self.engine
        engine.kv_blocks -= self.kv_blocks
        engine.finished += 1
        if self.holding and self.resumed is None:
            engine.release(self)

    async def prefill(self) -> None:
        options = self.engine.options
        uncached = len(self.tokens) - self.cached
        await asyncio.sleep((options.profile.ttft_ms + options.prefill_ms_per_token * uncached) / 1000.0)
        if self.resumed is not None:
            await self._resume(self.resumed)
        self.engine.generation_tokens += 1

    def generated(self, answer: list[str]) -> None:
        """The answer is complete: cache the blocks of prompt and answer, but for its last token (never fed back)."""
        engine = self.engine
        engine.store(engine.hashes([*self.tokens, *answer][:-1], self.blocks))

    async def decode(self) -> None:
        options = self.engine.options
        slowdown = 1.0 + options.batch_slowdown * max(0, self.engine.running - 1)
        await asyncio.sleep(options.profile.tpot_ms * slowdown / 1000.0)
        if self.resumed is not None:
            await self._resume(self.resumed)
        self.engine.generation_tokens += 1

    async def _resume(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        """Preempted: wait for a slot again in its old place, then recompute its prefix (cached: the base
        prefill time) before the token it was computing."""
        engine = self.engine
        self.holding = False
        await engine.wait(entry)
        self.resumed = None
        self.holding = True
        engine.batch[self] = (self.priority, self.arrival)
        await asyncio.sleep(engine.options.profile.ttft_ms / 1000.0)


def prompt_count(endpoint: str, body: dict[str, Any]) -> int | None:
    """How many tokens a request's prompt has, as the simulation counts them; None for a request the
    simulation's own validation will refuse (no messages, no prompt)."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if endpoint == "chat/completions" and not (isinstance(messages, list) and messages):
        return None
    if endpoint == "completions" and not isinstance(prompt, (str, list)):
        return None
    try:
        return len(prompt_tokens(endpoint, body))
    except (KeyError, TypeError, AttributeError):
        return None


def answer_tokens(endpoint: str, text: str) -> list[str]:
    """The tokens a replica computes after the prompt, as the next prompt will hold them: a chat answer in its
    template's framing (the generation prompt, the text, the end of turn), a completion's text as it is."""
    if endpoint == "chat/completions":
        return chat_tokens([{"role": "assistant", "content": text}])
    return text.split()


def prompt_tokens(endpoint: str, body: dict[str, Any]) -> list[str]:
    """The simulated tokens of a validated chat or completions request."""
    if endpoint == "chat/completions":
        return chat_tokens(body["messages"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.split()
    tokens: list[str] = []
    for item in prompt or ():  # strings, token ids, or arrays of token ids, as the simulation counts them
        tokens += (
            item.split() if isinstance(item, str) else [str(i) for i in item] if isinstance(item, list) else [str(item)]
        )
    return tokens


async def openai(
    engine: Engine,
    endpoint: str,
    body: dict[str, Any],
    model: str,
    error: Callable[[int, bytes], Response] | None = None,
    report_cached: bool = True,
    ending: Callable[[list[bytes]], list[bytes]] | None = None,
) -> Response:
    """An OpenAI-shaped chat or completions answer, paced by the replica.

    `error` reshapes a refusal into the stand-in's error format; `report_cached` puts the prefix-cache hit in
    usage.prompt_tokens_details.cached_tokens (servers that do not report it leave it out); `ending` reshapes
    a stream's last events (the finish chunk, the usage chunk if asked for, `[DONE]`).
    """
    profile = engine.options.profile
    probe = simulate(endpoint, body, model, profile)
    if probe.status != 200:
        return error(probe.status, probe.pieces[0]) if error else Response(probe.status, probe.pieces[0])
    if probe.tokens <= 1:
        engine.stats.warmups += 1  # what a warm-up looks like: max_tokens 1
    priority = body.get("priority")
    rank = priority if type(priority) is int else 0
    generation = engine.generation(prompt_tokens(endpoint, body), probe.tokens, rank)
    if not probe.stream:
        async with generation:
            reply = simulate(endpoint, body, model, profile, generation.cached if report_cached else None)
            await generation.prefill()
            for _ in range(reply.tokens - 1):
                await generation.decode()
            generation.generated(answer_tokens(endpoint, reply.text))
        return Response(200, reply.pieces[0])
    lead = 1 if endpoint == "chat/completions" else 0  # a chat stream opens with its role event

    async def events() -> AsyncIterator[bytes]:
        async with generation:
            reply = simulate(endpoint, body, model, profile, generation.cached if report_cached else None)
            pieces = reply.pieces
            last = lead + reply.tokens
            await generation.prefill()
            yield b"".join(pieces[: lead + 1])
            for piece in pieces[lead + 1 : last]:
                await generation.decode()
                yield piece
            generation.generated(answer_tokens(endpoint, reply.text))
            yield b"".join(ending(pieces[last:]) if ending else pieces[last:])

    return Response(200, events(), "text/event-stream")


def stats_response(engine: Engine) -> Response:
    return json_response(200, engine.snapshot())


def metric_lines(name: str, kind: str, help_text: str, value: float, labels: str) -> list[str]:
    """One Prometheus metric in the text format (a counter's family name drops `_total`, as prometheus_client does)."""
    family = name.removesuffix("_total") if kind == "counter" else name
    series = f"{name}{{{labels}}}" if labels else name
    return [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}", f"{series} {float(value)}"]
