"""``python -m analysis watch``: replay a run folder's eval records against a law, and draw them.

The expectation itself (the laws evaluated from curves.json or fit.json, the widened interval, the one warning)
is ``lab.training.expect``, the same code the training loop runs with ``--train.expect``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.table import InputError
from lab.runtime.files import read_json
from lab.training.expect import LawError, Watcher, watcher


def watch_run(run_dir: Path, law_path: str | Path) -> tuple[Watcher, list[str]]:
    """Replay a run folder's eval records (in progress or finished) through a Watcher; the lines it would print."""
    from analysis.curves import read_run

    curve, facts = read_run(Path(run_dir), "eval")
    cfg = read_json(Path(run_dir) / "config.json")["train"]
    try:
        w = watcher(law_path, curve.params, curve.lr, int(cfg["batch_tokens"]), curve.reference)
    except LawError as exc:
        raise InputError(str(exc)) from None
    lines = [f"run {facts['run_id']} (N={curve.params:.4g}, {curve.schedule}, {facts['steps']} steps) against "
             f"{w.kind} law {w.law_path}"]
    for step, loss in zip(curve.steps, curve.loss):
        e, warning = w.observe(int(step), float(loss))
        lines.append(f"step {step:>6} | eval loss {loss:.4f} | {e.line()}")
        if warning:
            lines.append(f"warning: {warning}")
    lines.append("on track: no warning" if w.warned_at is None else f"went off track at step {w.warned_at}")
    return w, lines


def figure(w: Watcher, title: str):
    """Observed eval losses against the expected curve and its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.unique(np.geomspace(max(1, w.history[0].step // 2), len(w.lr), 200).astype(int))
    expected = np.array([w.expect(int(s)) for s in steps])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(steps, expected[:, 0], color="C0", label=f"expected ({w.kind} law)")
    ax.fill_between(steps, expected[:, 1], expected[:, 2], color="C0", alpha=0.2, lw=0, label="interval")
    inside = np.array([e.inside for e in w.history])
    obs = np.array([[e.step, e.observed] for e in w.history])
    ax.scatter(obs[inside, 0], obs[inside, 1], color="black", s=12, label="eval loss, inside", zorder=3)
    ax.scatter(obs[~inside, 0], obs[~inside, 1], color="C3", s=16, label="eval loss, outside", zorder=3)
    if w.warned_at is not None:
        ax.axvline(w.warned_at, color="C3", ls="--", lw=1, label=f"off track at step {w.warned_at}")
    ax.set(xscale="log", xlabel="step", ylabel="eval loss (nats per token)", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
