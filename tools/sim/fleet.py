"""`sluice sim --replicas N` and `sluice sim --like ollama|llamacpp|tgi|vllm`: stand-in replicas in one process.

Replica i listens on port P + i (all on free ports when P is 0) and is built by the stand-in module of its
`--like` (vLLM unless told). They share one event loop and one uvicorn server; each keeps its own engine
(batch, queue, prefix cache) and load state. One line per replica says where it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from collections.abc import Awaitable, Callable

import uvicorn

from gateway.simulation.answers import Profile
from tools.sim import llamacpp as sim_llamacpp
from tools.sim import ollama as sim_ollama
from tools.sim import tgi as sim_tgi
from tools.sim import vllm as sim_vllm
from tools.sim.engine import BATCH, CACHE, LIKES, Options, Replica
from tools.sim.httpd import Request, Response, asgi, bind, server

_BUILDERS: dict[str, Callable[[Options, int], Replica]] = {
    "vllm": sim_vllm.build,
    "tgi": sim_tgi.build,
    "llamacpp": sim_llamacpp.build,
    "ollama": sim_ollama.build,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the replica model and the stand-ins (the single server ignores them)."""
    defaults = Options()
    p.add_argument("--replicas", type=int, help="run N stand-in replicas on ports P, P+1, ... (default like vllm)")
    p.add_argument("--like", choices=LIKES, help="behave like this server (one replica unless --replicas)")
    p.add_argument("--model", default=defaults.model, help="the model name served")
    p.add_argument("--max-batch", type=int, help="requests running at once (default 8, Ollama 1)")
    p.add_argument("--cache-blocks", type=int, help="prefix-cache capacity (default 1024, llama.cpp 16384)")
    p.add_argument("--block-tokens", type=int, help="tokens per cache block (default 16, llama.cpp 1)")
    p.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=defaults.prefill_ms_per_token,
        help="prefill time per prompt token not in the replica's cache",
    )
    p.add_argument("--batch-slowdown", type=float, default=defaults.batch_slowdown, help="decode slowdown per peer")
    p.add_argument("--load-ms", type=float, default=defaults.load_ms, help="model load time")
    p.add_argument("--idle-unload-s", type=float, default=defaults.idle_unload_s, help="Ollama's default keep_alive")
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len, help="context length in tokens")
    p.add_argument(
        "--priority-preemption",
        action="store_true",
        help="a waiting request preempts the running one of the lowest priority when that is strictly lower "
        "(SGLang's priority scheduling, vLLM's V0 engine); default: vLLM V1, which never preempts for a batch slot",
    )
    p.add_argument("--server-version", default="", help="the release to stand in for (TGI: its stream shape)")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the flags ask for stand-in replicas rather than the single server."""
    return args.replicas is not None or args.like is not None


def options(args: argparse.Namespace) -> Options:
    for name in ("replicas", "max_batch", "cache_blocks", "block_tokens", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            sys.exit(f"sluice sim: --{name.replace('_', '-')} must be at least 1")
    for name in ("ttft_ms", "tpot_ms", "prefill_ms_per_token", "batch_slowdown", "load_ms", "idle_unload_s"):
        if getattr(args, name) < 0:
            sys.exit(f"sluice sim: --{name.replace('_', '-')} must not be negative")
    return Options(
        like=args.like or "vllm",
        model=args.model,
        profile=Profile(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, tokens=args.tokens),
        max_batch=args.max_batch or BATCH[args.like or "vllm"],
        cache_blocks=args.cache_blocks or CACHE[args.like or "vllm"][1],
        block_tokens=args.block_tokens or CACHE[args.like or "vllm"][0],
        prefill_ms_per_token=args.prefill_ms_per_token,
        batch_slowdown=args.batch_slowdown,
        load_ms=args.load_ms,
        idle_unload_s=args.idle_unload_s,
        max_model_len=args.max_model_len,
        server_version=args.server_version,
        preemption=args.priority_preemption,
    )


def sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """Bound, not yet listening, sockets on port, port+1, ... (free ports when port is 0)."""
    return [bind(host, port + i if port else 0) for i in range(count)]


async def run(
    options: Options, bound: list[socket.socket], started: Callable[[uvicorn.Server], None] | None = None
) -> None:
    """Serve one replica per socket until the server is told to exit; `started` is called once listening."""
    replicas = [_BUILDERS[options.like](options, i) for i in range(len(bound))]
    delay = max(replica.listen_after_s for replica in replicas)
    if delay > 0:
        await asyncio.sleep(delay)  # vLLM and TGI open their port only once the model is loaded
    apps = {
        sock.getsockname()[1]: asgi(_counted(replica), i)
        for i, (sock, replica) in enumerate(zip(bound, replicas, strict=True))
    }
    http = server(apps)
    serving = asyncio.ensure_future(http.serve(sockets=bound))
    while not http.started and not serving.done():  # noqa: ASYNC110 (uvicorn's `started` is a flag, with no event)
        await asyncio.sleep(0.01)
    if http.started and started is not None:
        started(http)
    await serving


def _counted(replica: Replica) -> Callable[[Request], Awaitable[Response]]:
    stats = replica.engine.stats
    handler = replica.handler

    async def handle(request: Request) -> Response:
        stats.paths[request.path] += 1
        return await handler(request)

    return handle


def main(args: argparse.Namespace) -> None:
    """Serve the replicas the flags describe until interrupted."""
    chosen = options(args)
    try:
        bound = sockets(args.host, args.port, args.replicas or 1)
    except OSError as exc:
        sys.exit(f"sluice sim: cannot listen on {args.host} from port {args.port}: {exc.strerror}")

    def announce(_: uvicorn.Server) -> None:
        for i, sock in enumerate(bound):
            print(
                f"sluice sim replica {i} ({chosen.like}, model {chosen.model}) listening on "
                f"http://{args.host}:{sock.getsockname()[1]}/v1",
                flush=True,
            )

    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        runner: Callable[..., None] = asyncio.run
    else:
        runner = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(run(chosen, bound, announce))
