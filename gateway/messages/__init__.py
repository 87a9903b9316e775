"""Anthropic's Messages API as a front door: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Owns the intake of a Messages request (parsing, checks, the Exchange), its translation to chat completions for
OpenAI-shaped backends and of their answers back (whole and streamed), the passthrough to backends that serve
the Messages API themselves, and the errors of this route in Anthropic's shape. A request enters the one pipeline
(auth, rate limits, cache, SLO fallback, telemetry) like any other, through the intake's door for it.

Imports: contract, server, upstream, wire.
"""
