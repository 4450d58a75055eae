"""Entry point: see `python launch/export.py --help`."""

import sys

from lab.cli import export_main

if __name__ == "__main__":
    sys.exit(export_main())
