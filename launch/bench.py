"""Entry point: see `python launch/bench.py --help`."""

import sys

from lab.commands.bench import main

if __name__ == "__main__":
    sys.exit(main())
