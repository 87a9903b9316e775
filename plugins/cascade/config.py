"""The cascade plugin's config: per model, the smaller model tried first and what its answer must pass.

```yaml
models:
  chat:
    backend: large
    cascade:
      small: chat-small            # a model of this config, tried first
      mode: escalate               # escalate: the larger model at once; async: the small answer now, the
                                   # larger one in a background job named by x-sluice-cascade-job
      max_total_ms: 8000           # escalate: small and large together; async: the small answer
      checks: [empty, length, json, tool_args]   # the default: all four
      min_mean_logprob: -1.5       # also check the mean token log-probability (asks the small model for it)
```
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.settings import Strict

Check = Literal["empty", "length", "json", "tool_args"]
ALL_CHECKS: tuple[Check, ...] = ("empty", "length", "json", "tool_args")


class CascadeSpec(Strict):
    small: str = Field(min_length=1)
    mode: Literal["escalate", "async"] = "escalate"
    # The hard bound on what the client waits, from the request's arrival: past it an escalation is dropped
    # and the small answer served as it is (x-sluice-cascade: kept), or a 504 when there is none.
    max_total_ms: float = Field(10000.0, gt=0)
    checks: tuple[Check, ...] = ALL_CHECKS
    # Below this mean log-probability of the small answer's tokens, escalate. The small model is asked for
    # `logprobs` (and they are taken out again when the client did not ask); an answer without them fails.
    min_mean_logprob: float | None = Field(None, le=0)


class CascadeModel(Strict):
    """Its keys under `models.NAME`."""

    cascade: CascadeSpec | None = None
