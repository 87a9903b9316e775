"""The built-in simulated backend: deterministic OpenAI-compatible answers, as bytes, with no I/O.

It lets the quickstart, the tests and the benchmarks run with no key and no network. It may import
`gateway.server.completion` and `gateway.responses.events` (the wire forms it writes) and nothing else.
"""
