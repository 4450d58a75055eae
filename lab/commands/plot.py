"""``python -m lab plot RUN [RUN ...]``: one run's curves, or several overlaid, as PNG and SVG.

Five panels against the optimizer step, read from each run's ``metrics.jsonl`` (the run directory is all
it reads): training loss, held-out loss, learning rate, gradient norm and tokens/s.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from lab.runtime.config import ConfigError, Parser, print_error  # noqa: E402
from lab.runtime.files import loads_line, probe_writable, read_lines, write_atomic  # noqa: E402

# (metrics.jsonl key, panel title, log scale)
PANELS = (("loss", "training loss (nats/token)", False), ("eval_loss", "held-out loss (nats/token)", False),
          ("lr", "learning rate", False), ("grad_norm", "gradient norm (before clipping)", True),
          ("tokens_per_s", "tokens/s", False))
FORMATS = ("png", "svg")


def read_curves(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Each panel's (steps, values) from ``run_dir/metrics.jsonl``; blank or torn lines (a run killed mid-write)
    and null values (a skipped step's gradient norm) are left out. ConfigError when there is nothing to plot."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    curves: dict[str, tuple[list[int], list[float]]] = {key: ([], []) for key, _, _ in PANELS}
    try:
        lines = read_lines(path)  # bounded, never through a link
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None
    for line in lines:
        try:
            record = loads_line(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        for key, (steps, values) in curves.items():
            if isinstance(record.get(key), (int, float)):
                steps.append(record["step"])
                values.append(float(record[key]))
    if not any(steps for steps, _ in curves.values()):
        raise ConfigError(f"{path} holds no step records yet")
    return curves


def figure(runs: dict[str, dict[str, tuple[list[int], list[float]]]]) -> plt.Figure:
    """The five panels, one line per run (labelled by its folder name)."""
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.2 * len(PANELS)), sharex=True, layout="constrained")
    for ax, (key, title, log) in zip(axes, PANELS):
        for label, curves in runs.items():
            steps, values = curves[key]
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 3 else None, markersize=3, label=label)
        ax.set_title(title, fontsize=10, loc="left")
        if log and any(v > 0 for curves in runs.values() for v in curves[key][1]):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=8)
    return fig


def default_out(dirs: list[Path]) -> Path:
    """Where the figure goes without --out: into the run for one run; for several, into the nearest folder that
    holds them all (not the working directory), named after them (``curves-a-b``; ``curves-N-runs`` beyond 3)."""
    if len(dirs) == 1:
        return dirs[0] / "curves"
    names = [d.resolve().name for d in dirs]
    stem = "curves-" + ("-".join(names) if len(names) <= 3 else f"{len(names)}-runs")
    return Path(os.path.commonpath([d.resolve() for d in dirs])) / stem


def main(argv: list[str] | None = None, prog: str = "python -m lab plot") -> int:
    """Draw the runs' curves into OUT.png and OUT.svg; one ``error:`` line and exit 2 on bad input."""
    p = Parser(prog=prog, description="Plot one run's training curves, or several runs overlaid: loss, held-out "
                                      "loss, learning rate, gradient norm and tokens/s against the step.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories written by python -m lab train")
    p.add_argument("--out", help="the figure's path without its extension; .png and .svg are written "
                                 "(default: RUN/curves for one run; for several, curves-NAME-NAME... in the folder "
                                 "that holds them all)")
    args = p.parse_args(argv)
    dirs = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else default_out(dirs)
    try:
        if len({d.resolve() for d in dirs}) < len(dirs):
            raise ConfigError("a run is named twice")
        labels = [d.resolve().name for d in dirs]
        labels = labels if len(set(labels)) == len(labels) else [str(d) for d in dirs]
        runs = {label: read_curves(d) for label, d in zip(labels, dirs)}
        probe_writable(out.parent, "--out")
    except ConfigError as e:
        print_error(str(e))
        return 2
    fig = figure(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for fmt in FORMATS:
            buffer = io.BytesIO()
            fig.savefig(buffer, format=fmt, dpi=150)
            write_atomic(out.with_name(f"{out.name}.{fmt}"), buffer.getvalue())
    finally:
        plt.close(fig)
    print(f"wrote {', '.join(str(out.with_name(f'{out.name}.{fmt}')) for fmt in FORMATS)}")
    return 0
