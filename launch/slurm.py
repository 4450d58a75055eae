"""Entry point: see `python launch/slurm.py --help`."""

import sys

from lab.commands.slurm import main

if __name__ == "__main__":
    sys.exit(main())
