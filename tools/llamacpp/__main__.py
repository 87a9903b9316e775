"""`python -m tools.llamacpp build|where`: build (or find) the cached `llama-server`."""

import argparse
import sys

from tools.llamacpp.build import __doc__ as about
from tools.llamacpp.build import add_arguments, main

cli = argparse.ArgumentParser(prog="python -m tools.llamacpp", description=(about or "").split("\n")[0])
add_arguments(cli)
sys.exit(main(cli.parse_args()))
