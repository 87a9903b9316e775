"""The built-in simulated backend: deterministic OpenAI-compatible answers, as bytes, with no I/O.

It lets the quickstart, the tests and the benchmarks run with no key and no network: chat completions, legacy
completions and embeddings (answers.py) and the Responses API (responses.py); `sluice sim` and the engines'
stand-ins that play the same answers over HTTP are the tool `tools/sim/`.

Imports: wire.
"""
