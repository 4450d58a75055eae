"""Downstream task scores beside a run's summary: ``RUN_DIR/eval.json``, written by ``python -m lab eval``.

Plain JSON reading only (no torch), so that ``sweeps export`` and ``analysis`` read it as they read summary.json:
bounded, a plain file, never through a link (``lab.runtime.files.read_json``).
"""

from __future__ import annotations

from pathlib import Path

from lab.runtime.files import UnreadableFile, read_json

SCORES = "eval.json"
PREFIX = "task_"


def task_columns(run_dir: Path) -> dict[str, float]:
    """``task_NAME``: the first (primary) metric of each task scored in ``run_dir``; none without an eval.json."""
    path = Path(run_dir) / SCORES
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        tasks = read_json(path)["tasks"]
        return {f"{PREFIX}{name}": next(iter(entry["metrics"].values()))
                for name, entry in tasks.items() if entry["metrics"]}
    except (OSError, UnreadableFile, KeyError, TypeError, AttributeError, StopIteration):
        return {}
