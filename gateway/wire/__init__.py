"""The wire forms: what the APIs' bytes look like, made and read without the request path's state.

Stream marks (first token, usage, end) per endpoint, and the whole-answer and streamed forms of chat
completions, the Responses API and Anthropic's Messages API, for replays and the simulated backend. It imports
nothing from the rest of the gateway, so the server, upstream, telemetry and the front doors all use it.

Imports: none.
"""
