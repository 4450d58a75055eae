"""Watch a run against a law: the expected loss at each eval, its interval, the deviation, and a warning once the
run has been outside the interval for ``OFF_TRACK_EVALS`` evals in a row.

The law is a curves fit (``python -m analysis curves``' curves.json: the loss at every step of the run's own schedule)
or a fit.json (approach 3: L(N, D) with D the tokens seen so far, the loss a run of that length would end at, so
it reads high mid-way through a decaying schedule). The interval is the law's bootstrap interval at that point,
widened by ``WIDEN`` times the law's RMSE of log loss on its own runs: a run scatters about the law that much even
when it is on track. ``Watcher`` is used by the training loop (``--train.expect``) and by ``python -m analysis
watch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.table import InputError
from lab.runtime.files import read_json

OFF_TRACK_EVALS = 3
WIDEN = 2.0


@dataclass
class Expectation:
    step: int
    expected: float
    lo: float
    hi: float
    observed: float

    @property
    def deviation(self) -> float:
        """(observed - expected) / expected."""
        return (self.observed - self.expected) / self.expected

    @property
    def inside(self) -> bool:
        return self.lo <= self.observed <= self.hi

    def line(self) -> str:
        """The suffix of an eval line."""
        return (f"expected {self.expected:.4f} [{self.lo:.4f}, {self.hi:.4f}], {self.deviation:+.2%}"
                + ("" if self.inside else " OUTSIDE"))


@dataclass
class Watcher:
    """Expected losses of one run (N, its learning rate at every step, tokens per step) under a law."""

    law_path: str
    kind: str  # "curves" or "fit"
    params: float
    lr: np.ndarray
    batch_tokens: int
    curve_fit: object = None  # analysis.curves.CurveFit for kind "curves"
    point_law: object = None  # analysis.predict.Law for kind "fit"
    rmse: float = 0.0
    history: list[Expectation] = field(default_factory=list)
    warned_at: int | None = None

    def expect(self, step: int) -> tuple[float, float, float]:
        """(expected, lo, hi) at 1-based ``step``, the interval widened (see the module docstring)."""
        if self.kind == "curves":
            _, loss, lo, hi = self.curve_fit.predict(self.params, self.lr, np.array([step]))
        else:
            row = self.point_law.predict([self.params], [step * self.batch_tokens]).iloc[0]
            loss, lo, hi = np.array([row["loss"]]), np.array([row["lo"]]), np.array([row["hi"]])
        loss, lo, hi = float(loss[0]), float(lo[0]), float(hi[0])
        lo, hi = (loss, loss) if not (math.isfinite(lo) and math.isfinite(hi)) else (lo, hi)
        widen = math.exp(WIDEN * self.rmse)
        return loss, lo / widen, hi * widen

    def observe(self, step: int, loss: float) -> tuple[Expectation, str | None]:
        """Record one eval; returns its expectation and, the first time the run has been outside the interval for
        OFF_TRACK_EVALS evals in a row, the warning."""
        expected, lo, hi = self.expect(step)
        e = Expectation(step, expected, lo, hi, float(loss))
        self.history.append(e)
        recent = self.history[-OFF_TRACK_EVALS:]
        if self.warned_at is None and len(recent) == OFF_TRACK_EVALS and not any(x.inside for x in recent):
            self.warned_at = step
            return e, (f"OFF TRACK: the eval loss has been outside the law's interval for {OFF_TRACK_EVALS} evals in "
                       f"a row (steps {', '.join(str(x.step) for x in recent)}; now {loss:.4f} against "
                       f"{expected:.4f} [{lo:.4f}, {hi:.4f}], {e.deviation:+.2%}; law {self.law_path})")
        return e, None

    def summary(self) -> dict:
        """What the run's summary.json records."""
        last = self.history[-1] if self.history else None
        return {"law": self.law_path, "kind": self.kind, "evals": len(self.history),
                "outside": sum(not e.inside for e in self.history), "off_track_at_step": self.warned_at,
                "last": None if last is None else {"step": last.step, "expected": last.expected, "lo": last.lo,
                                                   "hi": last.hi, "observed": last.observed,
                                                   "deviation": last.deviation}}


def read_law(law_path: str | Path) -> tuple[str, dict]:
    """("curves", curves.json) or ("fit", fit.json) at ``law_path``; InputError for anything else."""
    path = Path(law_path)
    try:
        doc = read_json(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the law {path}: {' '.join(str(exc).split())}") from None
    if isinstance(doc, dict) and isinstance(doc.get("fit"), dict) and "law" in doc["fit"]:
        return "curves", doc
    if isinstance(doc, dict) and isinstance(doc.get("approach3"), dict):
        return "fit", doc
    raise InputError(f"{path}: neither a curves.json (python -m analysis curves) nor a fit.json (python -m analysis "
                     "fit)")


def watcher(law_path: str | Path, params: float, lr: np.ndarray, batch_tokens: int) -> Watcher:
    """A Watcher from a curves.json or a fit.json (``read_law``)."""
    kind, doc = read_law(law_path)
    if kind == "curves":
        from analysis.curves import load_fit

        fit = load_fit(doc)
        return Watcher(str(law_path), kind, float(params), np.asarray(lr, float), batch_tokens, curve_fit=fit,
                       rmse=fit.rmse_log_loss)
    from analysis.predict import load_law

    rmse = float((doc["approach3"].get("goodness") or {}).get("rmse_log_loss") or 0.0)
    return Watcher(str(law_path), kind, float(params), np.asarray(lr, float), batch_tokens,
                   point_law=load_law(law_path), rmse=rmse)


def watch_run(run_dir: Path, law_path: str | Path) -> tuple[Watcher, list[str]]:
    """Replay a run folder's eval records (in progress or finished) through a Watcher; the lines it would print."""
    from analysis.curves import read_run

    curve, facts = read_run(Path(run_dir), "eval")
    cfg = read_json(Path(run_dir) / "config.json")["train"]
    w = watcher(law_path, curve.params, curve.lr, int(cfg["batch_tokens"]))
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
