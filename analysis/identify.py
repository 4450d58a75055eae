"""Whether the data identify an approach's law: checks that must all pass before a law is used.

A fit always returns numbers; these checks say whether the numbers mean anything. Each check has
a name, a verdict and a one-line detail that the report and ``plan`` show. The thresholds:

- ``MAX_A_WIDTH``: an interval of the allocation exponent a wider than 0.2 cannot tell
  Chinchilla's a = 0.5 from Kaplan's 0.73, so it cannot guide a budget.
- ``EXPONENT_BOUNDS``: alpha and beta in (0, 2), the span of Hoffmann et al.'s start grid; every
  published fit lies well inside it.
- ``MAX_CONDITION``: the condition number of the Gauss-Newton matrix J^T J of approach 3
  (``parametric.gauss_newton_condition``): about 1e3 on IsoFLOP grids over several budgets, 1e9 and
  above on one budget, so 1e6 separates the two with room on both sides.
- A spread over the bound is the design's doing, not the data's (``Check.by_design``), when the same
  resamples of losses without noise (approach 3's law at the same runs) are as wide: approach 1 on an
  IsoFLOP grid takes each budget's N_opt from the sizes sampled, and a resample that leaves out a
  budget's lowest run moves its N_opt to a neighbouring size whatever the noise.
- ``MIN_POINTS`` usable budgets (approach 2) or distinct envelope sizes (approach 1): a power law
  through two points has no residual to check it by.
- ``MIN_DISTINCT`` distinct N and distinct D (approach 3): each of A/N^alpha and B/D^beta competes
  with E, and three values are the fewest that separate a power law from a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_A_WIDTH = 0.2
EXPONENT_BOUNDS = (0.0, 2.0)
MAX_CONDITION = 1e6
MIN_CONVERGED = 0.9
MIN_POINTS = 3
MIN_DISTINCT = 3


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    by_design: bool = False  # failed because of the design (what was sampled), whatever the runs' noise


@dataclass
class Identification:
    """The checks of one approach; identified when all pass."""

    checks: list[Check]

    @property
    def identified(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def by_design(self) -> bool:
        """Not identified, and only for reasons of the design: more runs of it would not identify the law."""
        failed = [c for c in self.checks if not c.passed]
        return bool(failed) and all(c.by_design for c in failed)

    @property
    def reasons(self) -> list[str]:
        return [c.detail for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"identified": self.identified, "reasons": self.reasons, "by_design": self.by_design,
                "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail, "by_design": c.by_design}
                           for c in self.checks]}


def refused(reason: str) -> Identification:
    """An approach that was not run on this data."""
    return Identification([Check("applicable", False, reason)])


def _width(interval: list[float] | None) -> float:
    return float("inf") if interval is None else interval[1] - interval[0]


def _spread_check(a_interval: list[float] | None, level: float) -> Check:
    if a_interval is None:
        return Check("bootstrap", True, "not checked: bootstrap disabled")
    width = _width(a_interval)
    return Check("bootstrap", width <= MAX_A_WIDTH,
                 f"{level:.0%} interval of a is [{a_interval[0]:.3g}, {a_interval[1]:.3g}], width {width:.3g} "
                 f"({'<=' if width <= MAX_A_WIDTH else '>'} {MAX_A_WIDTH:g})")


def parametric(params: dict[str, float], converged: bool, condition: float, n_distinct: int, d_distinct: int,
               min_loss: float, single_budget: bool, ci: dict | None, boot_converged: float | None,
               level: float, exponents: tuple[str, str] = ("alpha", "beta")) -> Identification:
    """Checks of approach 3: design, optimiser, plausible values, conditioning, bootstrap spread.

    ``exponents`` names the form's N and D exponents in ``params`` and ``ci``.
    """
    (name_n, name_d), e = exponents, params["E"]
    alpha, beta = params[name_n], params[name_d]
    lo, hi = EXPONENT_BOUNDS
    checks = [
        Check("budgets", not single_budget,
              "every run is at one compute budget: along C = kND the N and D terms cannot be told apart"
              if single_budget else "runs span more than one compute budget"),
        Check("sizes", n_distinct >= MIN_DISTINCT and d_distinct >= MIN_DISTINCT,
              f"{n_distinct} distinct N and {d_distinct} distinct D (need {MIN_DISTINCT} of each)"),
        Check("converged", converged, "the fit converged" if converged else "the fit did not converge"),
        Check("bounds", lo < alpha < hi and lo < beta < hi and e < min_loss,
              f"{name_n} = {alpha:.3g}, {name_d} = {beta:.3g} (plausible: {lo:g} to {hi:g}); "
              f"E = {e:.4g} {'<' if e < min_loss else '>='} the lowest loss {min_loss:.4g}"),
        Check("conditioning", condition <= MAX_CONDITION,
              f"condition number of J^T J {condition:.3g} ({'<=' if condition <= MAX_CONDITION else '>'} "
              f"{MAX_CONDITION:g})"),
    ]
    if ci is not None:
        inside = all(ci[k] is not None and lo < ci[k][0] and ci[k][1] < hi for k in exponents)
        checks.append(Check("exponent intervals", inside,
                            f"{level:.0%} intervals {name_n} {_fmt(ci[name_n])}, {name_d} {_fmt(ci[name_d])} "
                            f"{'inside' if inside else 'not inside'} ({lo:g}, {hi:g})"))
        checks.append(Check("bootstrap refits", boot_converged is not None and boot_converged >= MIN_CONVERGED,
                            f"{boot_converged:.0%} of bootstrap refits converged (need {MIN_CONVERGED:.0%})"))
    checks.append(_spread_check(None if ci is None else ci["a"], level))
    return Identification(checks)


def power_law(law: dict[str, float], n_points: int, what: str, a_interval: list[float] | None,
              level: float, noiseless_interval: list[float] | None = None) -> Identification:
    """Checks of approach 1 or 2: enough points, exponents in (0, 1), bootstrap spread; with
    ``noiseless_interval`` (the same resamples of losses without noise) a spread that the design alone leaves."""
    a, b = law["a"], law["b"]
    ok = bool(np.isfinite(a) and np.isfinite(b) and 0 < a < 1 and 0 < b < 1)
    return Identification([
        Check("points", n_points >= MIN_POINTS, f"{n_points} {what} (need {MIN_POINTS})"),
        Check("exponents", ok, f"a = {a:.3g}, b = {b:.3g} ({'both' if ok else 'not both'} in (0, 1))"),
        _design_spread(_spread_check(a_interval, level), noiseless_interval),
    ])


def _design_spread(spread: Check, noiseless: list[float] | None) -> Check:
    """``spread`` beside the interval the same resamples give on losses without noise: when that is too wide as
    well, the design, not the runs' noise, leaves the law unidentified."""
    if spread.passed or noiseless is None:
        return spread
    width = _width(noiseless)
    limited = width > MAX_A_WIDTH
    return Check(spread.name, False, f"{spread.detail}; on losses without noise (approach 3's law at the same runs) "
                 f"the same resamples give width {width:.3g}"
                 + (": the design limits it, not the runs' noise" if limited else ""), by_design=limited)


def _fmt(interval: list[float] | None) -> str:
    return "-" if interval is None else f"[{interval[0]:.3g}, {interval[1]:.3g}]"
