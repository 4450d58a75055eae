"""Plan a training run on paper: ``python launch/plan.py {time,memory,peaks} --help``."""

import sys

from lab.commands.resources import main

if __name__ == "__main__":
    sys.exit(main())
