"""Entry point: see `python launch/run.py --help`."""

import sys

from lab.commands.cli import run_main

if __name__ == "__main__":
    sys.exit(run_main())
