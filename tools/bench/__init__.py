"""`sluice bench`: the gateway's added latency against a direct connection, scenario by scenario."""
