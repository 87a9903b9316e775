"""Benchmarks that are not part of the gateway: each module runs with `python3 -m bench.NAME`."""
