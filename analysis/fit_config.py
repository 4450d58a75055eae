"""The options of a fit (``FitConfig``) and the values its choices take."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from analysis.isoflop import METHODS
from analysis.other_laws import LAWS
from analysis.robust import HUBER_DELTA
from analysis.table import InputError
from lab.measure.laws import FORMS

FORM_CHOICES = ("auto", *FORMS)
# What approach 1 takes its points from: end points only (final losses), or every point of the training curves,
# valid only when each logged point is an end point (see analysis.envelope).
ENVELOPE_SOURCES = ("final", "curves")
RUNTIME = ("progress", "stop_unidentified")  # how the fit runs, not what it computes: left out of fit.json


@dataclass
class FitConfig:
    """Options of a fit; the defaults follow the issue and Hoffmann et al."""

    budget_tol: float = 0.05  # relative spread of C within one budget
    isoflop_minimum: str = "akima"  # which per-budget minimum the IsoFLOP power laws use (analysis.isoflop)
    n_bootstrap: int = 1000
    seed: int = 0
    ci_level: float = 0.95
    workers: int = 1  # processes for the bootstrap
    n_starts: int = 8  # engine runs from the best grid points
    predict: tuple[float, ...] = ()  # FLOP budgets; empty: 1x, 10x and 100x the largest C in the data
    holdout: bool = True
    extrapolation_warn: float = 100.0  # warn when a prediction exceeds this multiple of the data's C
    envelope: str = "final"  # approach 1's points: one of ENVELOPE_SOURCES
    huber_delta: float = HUBER_DELTA  # approach 3's Huber threshold on log-loss residuals
    holdout_budgets: int = 1  # the hold-out keeps back this many of the largest budgets ...
    holdout_above: float | None = None  # ... or, when set, every run with C above this
    delta_sensitivity: bool = True  # refit approach 3 at each of DELTA_GRID for the report
    law: str = "chinchilla"  # a form of L(N, D) fitted beside approach 3 (analysis.other_laws), or only approach 3
    form: str = "chinchilla"  # approach 3's form (lab.measure.laws), or "auto": chosen by the hold-out
    progress: bool = field(default=True, compare=False)
    # stop before the bootstrap (``fit.TooFewRuns``) when the budgets are too few for approach 2 and no approach
    # can be identified whatever its intervals
    stop_unidentified: bool = field(default=False, compare=False)

    def validate(self) -> None:
        """Raise InputError for an option that cannot work."""
        checks = [
            (self.budget_tol >= 0, f"budget tolerance must be >= 0, got {self.budget_tol}"),
            (self.isoflop_minimum in METHODS, f"IsoFLOP minimum must be one of {', '.join(METHODS)}"),
            (self.n_bootstrap >= 0, f"bootstrap count must be >= 0, got {self.n_bootstrap}"),
            (0 < self.ci_level < 1, f"interval level must be in (0, 1), got {self.ci_level}"),
            (self.workers >= 1, f"workers must be >= 1, got {self.workers}"),
            (self.n_starts >= 1, f"starts must be >= 1, got {self.n_starts}"),
            (all(math.isfinite(c) and c > 0 for c in self.predict), "--predict budgets must be positive FLOPs"),
            (self.envelope in ENVELOPE_SOURCES, f"envelope source must be one of {', '.join(ENVELOPE_SOURCES)}"),
            (math.isfinite(self.huber_delta) and self.huber_delta > 0,
             f"--huber-delta must be a positive number, got {self.huber_delta}"),
            (self.holdout_budgets >= 1, f"--holdout-budgets must be >= 1, got {self.holdout_budgets}"),
            (self.law in LAWS, f"--law must be one of {', '.join(LAWS)}, got '{self.law}'"),
            (self.form in FORM_CHOICES, f"--form must be one of {', '.join(FORM_CHOICES)}, got '{self.form}'"),
            (self.holdout_above is None or (math.isfinite(self.holdout_above) and self.holdout_above > 0),
             f"--holdout-above must be positive FLOPs, got {self.holdout_above}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)
