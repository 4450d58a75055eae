"""``python -m lab``: see lab/commands/entry.py."""

import sys

from lab.commands.entry import main

sys.exit(main())
