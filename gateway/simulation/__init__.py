"""The built-in simulated backend: deterministic OpenAI-compatible answers, as bytes, with no I/O.

It lets the quickstart, the tests and the benchmarks run with no key and no network: chat completions, legacy
completions and embeddings (answers.py) and the Responses API (responses.py). It may import `gateway.wire` (the
byte forms it writes) and nothing else.
"""
