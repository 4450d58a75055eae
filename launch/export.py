"""Entry point: see `python launch/export.py --help`."""

import sys

from lab.commands.cli import export_main

if __name__ == "__main__":
    sys.exit(export_main())
