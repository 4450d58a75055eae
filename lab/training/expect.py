"""Watch a run against a law: the expected loss at each eval, its interval, the deviation, and a warning once the
run has been outside the interval for ``OFF_TRACK_EVALS`` evals in a row.

The law is a curves fit (``python -m analysis curves``' curves.json: ``CURVE_LAW`` along the run's own schedule)
or a fit.json (approach 3: L(N, D) with D the tokens seen so far, the loss a run of that length would end at,
so it reads high mid-way through a decaying schedule). The interval is the law's bootstrap interval at that
point, widened by ``WIDEN`` times the law's RMSE of log loss on its own runs: a run scatters about the law that
much even when it is on track. The laws are evaluated here from their files, so that
the training loop (``--train.expect``) needs nothing of ``analysis``: the laws themselves are ``lab.measure.laws``,
which the fits use too; ``python -m analysis watch`` uses the same ``Watcher``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from lab.measure import accounting
from lab.measure.laws import CURVE_LAW, CURVE_THETA, FORMS, curve_loss, point_loss
from lab.runtime.config import ConfigError, RunConfig
from lab.runtime.files import read_json
from lab.training import schedule

OFF_TRACK_EVALS = 3
WIDEN = 2.0


class LawError(ValueError):
    """A law file that cannot be used; the message is one line."""


def band(samples: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval at ``level`` of the finite samples (NaN, NaN without any)."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return math.nan, math.nan
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(finite, [tail, 100.0 - tail])
    return float(lo), float(hi)


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
    """Expected losses of one run under a law: ``law(step)`` is (loss, lo, hi) at a 1-based step, unwidened."""

    law_path: str
    kind: str  # "curves" or "fit"
    lr: np.ndarray  # the run's rate at every step
    law: Callable[[int], tuple[float, float, float]]
    rmse: float = 0.0
    history: list[Expectation] = field(default_factory=list)
    warned_at: int | None = None

    def expect(self, step: int) -> tuple[float, float, float]:
        """(expected, lo, hi) at 1-based ``step``, the interval widened (see the module docstring)."""
        loss, lo, hi = self.law(step)
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
                       f"{expected:.4f} [{lo:.4f}, {hi:.4f}], {e.deviation:+.2%})")
        return e, None

    def eval_fields(self, step: int, loss: float) -> tuple[dict, str, str | None]:
        """``observe`` as an eval reports it: the eval record's fields, the suffix of its line and the warning."""
        e, off_track = self.observe(step, loss)
        fields = {"expected_loss": e.expected, "expected_interval": [e.lo, e.hi], "deviation": e.deviation}
        return fields | ({"warning": off_track} if off_track else {}), f" | {e.line()}", off_track

    def summary(self) -> dict:
        """What the run's summary.json records."""
        last = self.history[-1] if self.history else None
        return {"law": self.law_path, "kind": self.kind, "evals": len(self.history),
                "outside": sum(not e.inside for e in self.history), "off_track_at_step": self.warned_at,
                "last": None if last is None else {"step": last.step, "expected": last.expected, "lo": last.lo,
                                                   "hi": last.hi, "observed": last.observed,
                                                   "deviation": last.deviation}}


def read_law(law_path: str | Path) -> tuple[str, dict]:
    """("curves", curves.json) or ("fit", fit.json) at ``law_path``; LawError for anything else."""
    path = Path(law_path)
    try:
        doc = read_json(path, follow=True)
    except (OSError, ValueError) as exc:  # UnreadableFile is a ValueError
        raise LawError(f"cannot read the law {path}: {' '.join(str(exc).split())}") from None
    if isinstance(doc, dict) and isinstance(doc.get("fit"), dict) and "law" in doc["fit"]:
        return "curves", doc
    if isinstance(doc, dict) and isinstance(doc.get("approach3"), dict):
        return "fit", doc
    raise LawError(f"{path}: neither a curves.json (python -m analysis curves) nor a fit.json (python -m analysis "
                   "fit)")


def _curves_law(doc: dict, path: Path, params: float, lr: np.ndarray, peak: float) -> tuple[Callable, float]:
    fit = doc["fit"]
    if fit["law"] != CURVE_LAW:
        raise LawError(f"{path}: a curves law of another form ('{fit['law']}', not '{CURVE_LAW}'): fit it again "
                       "with python -m analysis curves")
    theta = np.asarray(fit["theta"], float).reshape(len(CURVE_THETA))
    thetas = None if fit.get("resamples") is None else np.asarray(fit["resamples"], float).reshape(-1, len(theta))
    level = float(fit.get("level", 0.95))

    def law(step: int) -> tuple[float, float, float]:
        loss = float(curve_loss(theta, params, lr, [step], peak)[0])
        if thetas is None:
            return loss, math.nan, math.nan
        return (loss, *band(np.array([curve_loss(t, params, lr, [step], peak)[0] for t in thetas]), level))
    return law, float(fit["rmse_log_loss"])


def _point_law(doc: dict, path: Path, params: float, batch_tokens: int) -> tuple[Callable, float]:
    a3 = doc["approach3"]
    form = a3.get("form", "chinchilla")
    if form not in FORMS:
        raise LawError(f"{path}: unknown approach 3 form '{form}' (known: {', '.join(FORMS)})")
    best = {k: float(a3[k]) for k in FORMS[form].names}
    boot = path.parent / "bootstrap.csv"
    import pandas as pd

    samples = pd.read_csv(boot) if boot.is_file() else None
    resamples = None if samples is None else {k: samples[k].to_numpy(float) for k in FORMS[form].names}
    level = float((doc.get("config") or {}).get("ci_level", 0.95))

    def law(step: int) -> tuple[float, float, float]:
        tokens = step * batch_tokens
        loss = float(point_loss(form, best, params, tokens))
        if resamples is None:
            return loss, math.nan, math.nan
        return (loss, *band(np.asarray(point_loss(form, resamples, params, tokens), float), level))
    return law, float((a3.get("goodness") or {}).get("rmse_log_loss") or 0.0)


def watcher(law_path: str | Path, params: float, lr: np.ndarray, batch_tokens: int, peak: float = 0.0) -> Watcher:
    """A Watcher of a run of ``params`` with the rate ``lr`` at every step (configured peak ``peak``; 0: the largest
    of ``lr``) under a curves.json or a fit.json."""
    kind, doc = read_law(law_path)
    lr = np.asarray(lr, float)
    try:
        law, rmse = (_curves_law(doc, Path(law_path), float(params), lr, float(peak)) if kind == "curves"
                     else _point_law(doc, Path(law_path), float(params), batch_tokens))
    except LawError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise LawError(f"{law_path}: not a usable {kind} law ({type(exc).__name__}: {exc})") from None
    return Watcher(str(law_path), kind, lr, law, rmse)


def for_run(cfg: RunConfig, total_steps: int, earlier: list[dict]) -> Watcher | None:
    """train.expect's watcher (None without it): the run's N and its schedule's rate at every step under the law; a
    resumed run's watcher has seen its ``earlier`` eval records, so it warns once over the whole run."""
    if not cfg.train.expect:
        return None
    lr = [schedule.learning_rate(s, total_steps, cfg.train) for s in range(total_steps)]
    try:
        run_watcher = watcher(cfg.train.expect, accounting.param_counts(cfg.model).total, lr, cfg.train.batch_tokens,
                              cfg.train.lr)
    except LawError as e:
        raise ConfigError(f"train.expect: {e}") from None
    for rec in earlier:
        run_watcher.observe(rec["step"], rec["eval_loss"])  # a warning among them was given when its segment ran
    return run_watcher
