"""The worker hand-off: what `sluice serve --workers N` (gateway/cli.py) passes to each worker it starts.

uvicorn's workers import the app themselves (`gateway.app:create_app`), so the supervisor can hand them nothing
but the environment. Each name is written by the supervisor before it starts the workers and read by a worker
as it builds its app; a process started any other way (one worker, the tests, an embedding) has none of them.
"""

from __future__ import annotations

CONFIG = "SLUICE_CONFIG"  # the config file's absolute path (also the operator's own default for -c)
ACCESS_LOG = "SLUICE_ACCESS_LOG"  # "1": --access-log was given
LISTEN = "SLUICE_LISTEN"  # host:port as the supervisor listens (its --host, --port): who sees the admin routes
SUPERVISOR = "SLUICE_SUPERVISOR_PID"  # the supervisor's pid: each worker exits with it (gateway/server/lifeline.py)
METRICS_DIR = "SLUICE_METRICS_DIR"  # where each worker writes its metrics for a scrape to sum (metric_files.py)
# Read by the supervisor only, from the operator: used as METRICS_DIR but not passed on as such, since it would put
# prometheus_client in its own multiprocess mode (one file write per observation).
PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"
