"""What a gateway's process imports: redis-py never (its import alone costs ~25 MB of resident memory; the
gateway speaks RESP itself, gateway/state/resp.py and subscriber.py)."""

from __future__ import annotations

import subprocess
import sys

from gateway.plugin import BUILTIN


def test_a_gateway_with_every_plugin_never_imports_redis_py() -> None:
    modules = sorted({path.partition(":")[0] for path in BUILTIN.values()})
    script = (
        "import sys\n"
        "import gateway.app, gateway.cli, gateway.runtime, gateway.state.store\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m == 'redis' or m.startswith('redis.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
