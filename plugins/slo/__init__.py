"""slo: route around a model that is breaking its latency or error SLO, before the clients feel it for long.

For every model with `slo:` the plugin keeps a sliding window of what it served: the TTFT of its streams and
its failures (errors, timeouts, 429s, missed first-token deadlines). When the window's p95 TTFT or error
rate breaks the SLO (with at least `min_samples`), the model is *degraded*: new requests go to its first
fallback, the primary kept last as a resort. A share of traffic (`probe_ratio`) still goes to the primary;
once `cooldown_s` has passed and `recovery_samples` probes in a row beat the SLO by `recovery_margin`, the
model is healthy again and its window starts afresh. The margin, the cool-down and the fresh window are
the hysteresis that keeps it from flapping.

The plugin also grants hedging (`hedge_after_ms`): a request may race the next target when its primary is
slow to give a first token, but only while the tenant's hedged share stays under `max_hedge_ratio`, so a
slow primary cannot double the load. `gateway/upstream/attempts.py` executes both decisions; this module only
orders `ex.targets` and sets `ex.hedge_after_ms`.

Only streams give TTFT samples: a non-stream answer's latency is its whole generation, not comparable.
"""

from plugins.slo.config import SloModel, SloSettings
from plugins.slo.policy import DEGRADED, HEALTHY, HedgeBudget, ModelSlo, Slo, Window

__all__ = ["DEGRADED", "HEALTHY", "HedgeBudget", "ModelSlo", "Slo", "SloModel", "SloSettings", "Window"]
