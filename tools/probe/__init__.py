"""`sluice probe`: the latency breakdown and diagnosis of any OpenAI-compatible endpoint."""
