"""How far a running run has got, read from the tail of its ``metrics.jsonl`` (the run directory is the
only thing the sweep reads of a run)."""

from __future__ import annotations

from pathlib import Path

from lab.runtime.files import loads_line, read_tail
from sweeps.runs import PlannedRun

_TAIL_BYTES = 16384  # far more than one record: only the end of a long metrics file is read


def last_step(run_dir: Path) -> int:
    """The newest step recorded in ``run_dir/metrics.jsonl`` (0 before the first record)."""
    try:
        lines = read_tail(run_dir / "metrics.jsonl", _TAIL_BYTES).decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):  # the last line may be half written, the first one cut by the seek
        try:
            return int(loads_line(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def total_steps(run: PlannedRun) -> int:
    """The run's optimizer steps: the planner rounds its tokens to whole batches."""
    return -(-run.tokens // run.batch_tokens)


def describe(run: PlannedRun, run_dir: Path) -> str:
    """``step 120/1,400 (9 %)``: a running run's progress."""
    step, total = last_step(run_dir), total_steps(run)
    return f"step {step:,}/{total:,} ({100 * step // total} %)"
