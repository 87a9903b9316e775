"""The slo plugin's settings: each model's `slo:` and its hedging (`models.NAME`).

Apart from the policy so that it can be compiled (setup.py): mypyc compiles no class whose attributes default
to a pydantic `Field`.
"""

from __future__ import annotations

from pydantic import Field

from gateway.settings import Strict


class SloSettings(Strict):
    ttft_p95_ms: float = Field(800.0, gt=0)
    max_error_rate: float = Field(0.05, ge=0, le=1)
    window_s: float = Field(30.0, gt=0)
    min_samples: int = Field(20, ge=1)
    probe_ratio: float = Field(0.05, ge=0, le=1)  # share of traffic that keeps trying a degraded primary
    cooldown_s: float = Field(10.0, ge=0)  # the least time spent degraded
    recovery_samples: int = Field(5, ge=1)  # good probes in a row needed to return
    recovery_margin: float = Field(0.8, gt=0, le=1)  # probes must beat the SLO by this factor (hysteresis)


class SloModel(Strict):
    """Its keys under `models.NAME`."""

    slo: SloSettings | None = None
    hedge_after_ms: float | None = Field(None, gt=0)  # race the next target when no first token by then
    max_hedge_ratio: float = Field(0.1, ge=0, le=1)  # of a tenant's requests to the model, per minute
