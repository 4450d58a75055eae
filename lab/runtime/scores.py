"""Downstream task scores beside a run's summary: ``RUN_DIR/eval.json``, written by ``python -m lab eval``.

Plain JSON reading only (no torch), so that ``sweeps export`` and ``analysis`` read it as they read summary.json.
"""

from __future__ import annotations

import json
from pathlib import Path

SCORES = "eval.json"
PREFIX = "task_"


def task_columns(run_dir: Path) -> dict[str, float]:
    """``task_NAME``: the first (primary) metric of each task scored in ``run_dir``; none without an eval.json."""
    path = Path(run_dir) / SCORES
    if not path.is_file():
        return {}
    try:
        tasks = json.loads(path.read_text())["tasks"]
        return {f"{PREFIX}{name}": next(iter(entry["metrics"].values()))
                for name, entry in tasks.items() if entry["metrics"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
