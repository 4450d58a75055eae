"""``python -m sweeps``: see sweeps/cli.py."""

import sys

from sweeps.cli import main

sys.exit(main())
