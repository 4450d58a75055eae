"""Entry point: see `python launch/run.py --help`."""

import sys

from lab.cli import run_main

if __name__ == "__main__":
    sys.exit(run_main())
