"""The test suite.

Set before anything imports numpy (the test embedding server does): one BLAS thread per process. On a shared
2-core machine a BLAS thread pool per process oversubscribes the cores: one embedding took 100-700 ms instead
of ~25 ms.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
