"""`python -m tools.bench`: the same as `sluice bench`."""

import sys

from gateway.cli import main

main(["bench", *sys.argv[1:]])
