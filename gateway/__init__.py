"""Sluice: a latency-first, OpenAI-compatible LLM gateway."""

__version__ = "0.1.0"
