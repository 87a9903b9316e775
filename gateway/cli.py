"""`sluice`: parse the command line and hand over to the part that does the work."""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence

from gateway import __version__
from gateway.config import describe, parse, read, warnings
from gateway.plugin import BUILTIN_COMMANDS, COMMAND_ALIASES
from gateway.settings import ConfigError, Settings

CONFIG_HELP = "YAML config (default: $SLUICE_CONFIG, else ./config/gateway.yaml, else the built-in quickstart)"


def _config(path: str | None) -> Settings:
    """The config, checked as `serve` would build it; every problem on a line of its own, then exit 2."""
    try:
        text, source = read(path)
        settings = parse(text, source)
        asyncio.run(_build(settings, source))
    except ConfigError as exc:
        for line in exc.lines:
            print(f"sluice: config error: {line}", file=sys.stderr)
        sys.exit(2)
    return settings


async def _build(settings: Settings, source: str) -> None:
    """Everything `serve` builds, short of opening sockets: providers, pools, plugins, telemetry."""
    from gateway.runtime import Runtime

    try:
        runtime = Runtime(settings)
    except ConfigError as exc:
        raise ConfigError(*(f"{source}: {line}" for line in exc.lines)) from None
    await runtime.aclose()


def serve(args: argparse.Namespace) -> None:
    import logging.config

    import uvicorn

    from gateway import handoff
    from gateway.settings import Listen, LogSettings
    from gateway.telemetry import logs
    from gateway.upstream import descriptors

    settings = _config(args.config)
    log = LogSettings(
        level=args.log_level or settings.log.level,
        format=args.log_format or settings.log.format,
        access=args.access_log or settings.log.access,
    )
    port = args.port if args.port is not None else settings.listen.port
    listen = Listen(host=args.host or settings.listen.host, port=port)
    settings = settings.model_copy(update={"listen": listen, "log": log})
    _can_listen(listen.host, listen.port)  # before the start-up summary says "listening on"
    log_config = logs.config(log.level, log.format)
    logging.config.dictConfig(log_config)
    for line in warnings(settings):  # said once, by the process that read the config, as `sluice check` says it
        logging.getLogger("sluice").warning("%s", line.removeprefix("warning: "))
    descriptors.log_limit(*descriptors.raise_limit())  # before uvicorn binds and forks: workers inherit it
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
            os.environ[handoff.CONFIG] = os.path.abspath(args.config)
        if log.access:
            os.environ[handoff.ACCESS_LOG] = "1"
        # Each worker ties itself to this process and exits when it dies, however (gateway/server/lifeline.py).
        os.environ[handoff.SUPERVISOR] = str(os.getpid())
        os.environ[handoff.LISTEN] = f"{listen.host}:{listen.port}"  # what --host and --port made of the config
        # Each worker writes its metrics to files in this directory, in batches, and a scrape sums them
        # (gateway/telemetry/metric_files.py). A PROMETHEUS_MULTIPROC_DIR given is used as that directory,
        # but not passed on as such: it would put prometheus_client in its own mode, one file write per observation.
        metrics_dir = None
        given = os.environ.pop(handoff.PROMETHEUS_DIR, "")
        if given:
            os.environ[handoff.METRICS_DIR] = given
        else:
            metrics_dir = os.environ[handoff.METRICS_DIR] = tempfile.mkdtemp(prefix="sluice-metrics-")
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


def _can_listen(host: str, port: int) -> None:
    """Bind and let go, as uvicorn will bind: a port in use is said now, in one line, before anything starts."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it: TIME_WAIT is no conflict
        probe.bind((host, port))


def check(args: argparse.Namespace) -> None:
    settings = _config(args.config)
    print(describe(settings))
    for line in warnings(settings):
        print(line)


# What the CLI offers beside serving: (module, help). Each module has add_arguments(parser) and
# main(args) -> exit code, and is imported only when its own command runs, so `sluice serve` loads none.
TOOLS: dict[str, tuple[str, str]] = {
    "sim": ("tools.sim.command", "run a simulated OpenAI-compatible upstream"),
    "bench": ("tools.bench.command", "measure the gateway's added latency against a direct connection"),
    "demo": ("tools.demo", "watch the SLO fallback, the cache and the overhead live (about 45 s)"),
    "probe": ("tools.probe.command", "latency breakdown and diagnosis of any OpenAI-compatible endpoint"),
    **BUILTIN_COMMANDS,
}


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; a tool's own arguments are added only for `command`, the one being run."""
    root = argparse.ArgumentParser(prog="sluice", description="A latency-first, OpenAI-compatible LLM gateway.")
    root.add_argument("--version", action="version", version=f"sluice {__version__}")
    commands = root.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the gateway")
    p.add_argument("-c", "--config", help=CONFIG_HELP)
    p.add_argument("--host", help="address to listen on (default: the config's listen.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: the config's listen.port, 8080)")
    p.add_argument(
        "--workers", type=int, default=1, help="worker processes sharing the port (default: 1; about one per core)"
    )
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], help="default: info")
    p.add_argument("--log-format", choices=["text", "json"], help="json: one object per line (default: text)")
    p.add_argument("--access-log", action="store_true", help="one line per request, after it ended")
    p.set_defaults(run=serve)

    p = commands.add_parser("check", help="validate a config as `serve` would build it, and exit")
    p.add_argument("-c", "--config", help=CONFIG_HELP)
    p.set_defaults(run=check)

    for name, (module, summary) in TOOLS.items():
        p = commands.add_parser(name, help=summary)
        if name == command:
            tool = importlib.import_module(module)
            tool.add_arguments(p)
            p.set_defaults(run=lambda args, tool=tool: sys.exit(tool.main(args)))
    return root


def main(argv: Sequence[str] | None = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    at = next((i for i, word in enumerate(words) if not word.startswith("-")), None)
    command = words[at] if at is not None else None
    if at is not None and at + 1 < len(words) and (command, words[at + 1]) in COMMAND_ALIASES:
        command = words[at] = COMMAND_ALIASES[(words[at], words[at + 1])]
    args = parser(command).parse_args(words)
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
