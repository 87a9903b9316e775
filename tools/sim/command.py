"""`sluice sim`: one simulated OpenAI-compatible upstream, or a fleet of engine stand-ins (fleet.py)."""

from __future__ import annotations

import argparse

from gateway.simulation.answers import Profile
from tools.sim import fleet, server


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--ttft-ms", type=float, default=150.0, help="time to the first token (default: 150)")
    p.add_argument("--tpot-ms", type=float, default=15.0, help="time per output token after it (default: 15)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer (default: 16)")
    p.add_argument(
        "--stamp-first-token",
        action="store_true",
        help="precede a stream's first token with `: sent SECONDS` (an SSE comment: when it was written, on the "
        "host's monotonic clock), so that a client on this host can measure what lies between",
    )
    fleet.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    if fleet.wanted(args):
        fleet.main(args)
        return 0
    profile = Profile(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, tokens=args.tokens)
    server.main(args.host, args.port, profile, args.stamp_first_token)
    return 0
