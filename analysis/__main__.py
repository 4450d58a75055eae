"""``python -m analysis``: see analysis/cli.py."""

import os
import sys

# The fits work on short vectors, where BLAS threads only add overhead and contend for the cores;
# this must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from analysis.cli import main  # noqa: E402

sys.exit(main())
