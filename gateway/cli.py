"""`sluice`: parse the command line and hand over to the part that does the work."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence

from gateway.settings import ConfigError, Settings, load


def _config(path: str | None) -> Settings:
    try:
        return load(path)
    except ConfigError as exc:
        sys.exit(f"sluice: config error: {exc}")


def serve(args: argparse.Namespace) -> None:
    import logging.config

    import uvicorn

    from gateway import logs
    from gateway.settings import Listen, LogSettings

    settings = _config(args.config)
    log = LogSettings(
        level=args.log_level or settings.log.level,
        format=args.log_format or settings.log.format,
        access=args.access_log or settings.log.access,
    )
    port = args.port if args.port is not None else settings.listen.port
    listen = Listen(host=args.host or settings.listen.host, port=port)
    settings = settings.model_copy(update={"listen": listen, "log": log})
    log_config = logs.config(log.level, log.format)
    logging.config.dictConfig(log_config)
    from gateway.app import SERVER_OPTIONS

    options: dict[str, object] = {
        **SERVER_OPTIONS,
        "host": listen.host,
        "port": listen.port,
        "loop": "uvloop",
        "log_level": log.level,
        "log_config": log_config,  # a dict, so that every worker process configures the same
        "timeout_graceful_shutdown": settings.shutdown.grace_s,
    }
    if args.workers > 1:
        # Workers import the app themselves; they find the same config through the environment.
        if args.config:
            os.environ["SLUICE_CONFIG"] = os.path.abspath(args.config)
        if log.access:
            os.environ["SLUICE_ACCESS_LOG"] = "1"
        # Prometheus multiprocess mode: each worker writes its metrics under this directory and a scrape sums
        # them. It must be in the environment before the workers start (prometheus_client reads it on import).
        metrics_dir = None
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sluice-metrics-")
        try:
            uvicorn.run("gateway.app:create_app", factory=True, workers=args.workers, **options)  # type: ignore[arg-type]
        finally:
            if metrics_dir is not None:
                shutil.rmtree(metrics_dir, ignore_errors=True)
    else:
        from gateway.app import create_app

        # uvicorn re-raises the SIGTERM it handled once it has shut down; a clean shutdown then exits 0.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        uvicorn.run(create_app(settings), **options)  # type: ignore[arg-type]


def check(args: argparse.Namespace) -> None:
    settings = _config(args.config)
    print(
        f"ok: {len(settings.backends)} backend(s), {len(settings.models)} model(s), plugins: "
        f"{', '.join(settings.plugins) or 'none'}"
    )


def sim(args: argparse.Namespace) -> None:
    from gateway.simulation import Profile
    from gateway.tools import sim as simulator

    simulator.main(args.host, args.port, Profile(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, tokens=args.tokens))


def keys(args: argparse.Namespace) -> None:
    from gateway.tools import keys as store

    if args.action == "new":
        store.new(args.tenant or "default")
        return
    url = args.redis if args.redis is not None else _config(args.config).redis.url
    if args.action == "list":
        store.list_keys(url)
        return
    hexdigest = store.hex_digest(args.key, args.hash)
    if args.action == "add":
        if not args.tenant:
            sys.exit("sluice keys add: --tenant is required")
        models = [m for m in args.models.split(",") if m] if args.models else None
        store.add(url, args.tenant, hexdigest, models)
    else:
        store.revoke(url, hexdigest)


def bench(args: argparse.Namespace) -> None:
    from gateway.tools import bench as benchmark

    sys.exit(benchmark.main(args))


def demo(args: argparse.Namespace) -> None:
    from gateway.tools import demo as show

    sys.exit(show.main(args))


def probe(args: argparse.Namespace) -> None:
    from gateway.tools import probe as prober

    sys.exit(prober.main(args))


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="sluice", description="A latency-first, OpenAI-compatible LLM gateway.")
    commands = root.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the gateway")
    p.add_argument("-c", "--config", help="YAML config (default: $SLUICE_CONFIG, else config/gateway.yaml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], help="default: info")
    p.add_argument("--log-format", choices=["text", "json"], help="json: one object per line (default: text)")
    p.add_argument("--access-log", action="store_true", help="one line per request, after it ended")
    p.set_defaults(run=serve)

    p = commands.add_parser("check", help="validate a config and exit")
    p.add_argument("-c", "--config")
    p.set_defaults(run=check)

    p = commands.add_parser("sim", help="run a simulated OpenAI-compatible upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ttft-ms", type=float, default=150.0)
    p.add_argument("--tpot-ms", type=float, default=15.0)
    p.add_argument("--tokens", type=int, default=16)
    p.set_defaults(run=sim)

    from gateway.tools import bench as benchmark

    p = commands.add_parser("bench", help="measure the gateway's added latency against a direct connection")
    benchmark.add_arguments(p)
    p.set_defaults(run=bench)

    from gateway.tools import demo as show

    p = commands.add_parser("demo", help="watch the SLO fallback, the cache and the overhead live (about 45 s)")
    show.add_arguments(p)
    p.set_defaults(run=demo)

    from gateway.tools import probe as prober

    p = commands.add_parser("probe", help="latency breakdown and diagnosis of any OpenAI-compatible endpoint")
    prober.add_arguments(p)
    p.set_defaults(run=probe)

    p = commands.add_parser("keys", help="make gateway keys; add, revoke and list them in Redis")
    p.add_argument("action", choices=["new", "add", "revoke", "list"])
    p.add_argument("--tenant")
    p.add_argument("--key", help="the key itself (add/revoke)")
    p.add_argument("--hash", help="the key's sha256:... (add/revoke)")
    p.add_argument("--models", help="comma-separated models the key may use (add; default: all)")
    p.add_argument("--redis", help="Redis URL (default: redis.url from the config)")
    p.add_argument("-c", "--config")
    p.set_defaults(run=keys)
    return root


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except OSError as exc:
        # A port in use or not ours to bind is a user's mistake: one line, not a traceback.
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            sys.exit(f"sluice {args.command}: {exc.strerror or exc}: {_bind_target(args)}")
        raise


def _bind_target(args: argparse.Namespace) -> str:
    host, port = getattr(args, "host", None), getattr(args, "port", None)
    return f"cannot listen on {host or '127.0.0.1'}:{port}" if port is not None else "cannot listen"


if __name__ == "__main__":
    main()
