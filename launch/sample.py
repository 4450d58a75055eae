"""Entry point: see `python launch/sample.py --help`."""

import sys

from lab.commands.cli import sample_main

if __name__ == "__main__":
    sys.exit(sample_main())
