"""Optional pipeline stages, each one module: auth, rate_limit, cache, slo."""
