"""Optional pipeline stages, one package (or module) each: auth, rate_limit, cache, slo, semantic_cache, admission.

Each owns its config schema and what it reports, uses the core (`gateway`), and never imports another plugin
(tests/unit/test_rooms.py checks it); the core loads them by name from the config and never imports one.
"""

import gateway  # noqa: F401  first: it decides whether compiled modules or their sources are imported
