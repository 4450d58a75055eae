"""The three approaches side by side: N_opt and D_opt at a budget, which law to use, and whether they agree.

Every approach ends in the same form, N_opt = k_N C^a and D_opt = k_D C^b (approach 3 through
a = beta/(alpha+beta) and k_N = G k^-a), fitted once to all runs and once per bootstrap resample.
All approaches are refitted on the same resamples, so the ratio of two approaches' N_opt can be
bootstrapped pair by pair: two approaches disagree at a budget when the interval of that ratio
excludes 1, i.e. their difference is larger than resampling the runs explains.

``plan`` and the report use the first identified approach in ``PREFERENCE``: approach 3 is the only
one that also predicts the loss, and approach 2 uses every budget's whole profile where approach
1 uses one run per point.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


from analysis.bootstrap import interval
from analysis.isoflop import PowerLaws
from lab.measure.laws import CHINCHILLA, Form
from analysis.parametric import named_samples

APPROACHES = ("envelope", "isoflop", "approach3")  # fit.json keys, in the paper's order
TITLES = {"envelope": "approach 1 (envelope)", "isoflop": "approach 2 (IsoFLOP)",
          "approach3": "approach 3 (parametric)"}
PREFERENCE = ("approach3", "isoflop", "envelope")
WHY = {"approach3": "it is identified and is the only approach that also predicts the loss",
       "isoflop": "approach 3 is not identified; approach 2 is, and uses every budget's whole profile",
       "envelope": "approaches 3 and 2 are not identified; approach 1 is"}


def parametric_allocation(thetas: np.ndarray, flops_k: float, form: Form = CHINCHILLA) -> PowerLaws:
    """Approach 3's N_opt = k_N C^a, D_opt = k_D C^b for each theta row (K, P), along C = flops_k N D."""
    s = named_samples(np.atleast_2d(thetas), flops_k, form)
    return PowerLaws(a=s["a"], k_n=s["k_N"], b=s["b"], k_d=s["k_D"], n_points=np.zeros(len(s["a"]), int))


@dataclass
class Allocation:
    """One approach's N_opt(C) and D_opt(C): the full-data law, its resamples, and its identification."""

    key: str
    law: PowerLaws  # one row
    samples: PowerLaws | None  # one row per bootstrap resample, aligned across approaches
    identified: bool
    reasons: list[str]

    def at(self, flops: float, level: float) -> dict:
        """N_opt and D_opt at ``flops`` with their intervals."""
        n, d = (float(v[0, 0]) for v in self.law.at(flops))
        out = {"params": n, "tokens": d, "ci": None}
        if self.samples is not None:
            ns, ds = (v[:, 0] for v in self.samples.at(flops))
            out["ci"] = {"params": interval(ns, level), "tokens": interval(ds, level)}
        return out


def preferred(status: dict[str, tuple[bool, list[str]]]) -> tuple[str | None, str]:
    """The approach to plan with and why, from (identified, reasons) per approach; None when none is."""
    for key in PREFERENCE:
        if key in status and status[key][0]:
            return key, WHY[key]
    reasons = "; ".join(f"{TITLES[k]}: {', '.join(status[k][1]) or 'no law'}" for k in APPROACHES if k in status)
    return None, f"no approach is identified ({reasons})"


def disagreements(allocations: dict[str, Allocation], flops: float, level: float) -> list[dict]:
    """Pairs of identified approaches whose N_opt at ``flops`` differ beyond their paired interval."""
    keys = [k for k in APPROACHES if k in allocations and allocations[k].identified]
    out = []
    for i, first in enumerate(keys):
        for second in keys[i + 1:]:
            x, y = allocations[first], allocations[second]
            ratio = float(x.law.at(flops)[0][0, 0] / y.law.at(flops)[0][0, 0])
            paired = None
            if x.samples is not None and y.samples is not None:
                paired = interval(x.samples.at(flops)[0][:, 0] / y.samples.at(flops)[0][:, 0], level)
            if paired is None:
                continue
            if not paired[0] <= 1.0 <= paired[1]:
                out.append({"flops": flops, "approaches": [first, second], "ratio": ratio, "ci": paired,
                            "message": f"at C = {flops:.3g}, {TITLES[first]} gives N_opt {ratio:.3g}x that of "
                                       f"{TITLES[second]} ({level:.0%} paired interval of the ratio "
                                       f"[{paired[0]:.3g}, {paired[1]:.3g}] excludes 1)"})
    return out


def disagreement_note(key: str, found: list[dict]) -> str:
    """'' or a loud clause naming the approaches that ``key``, the law in use, disagrees with."""
    others = sorted({TITLES[k] for x in found if key in x["approaches"] for k in x["approaches"] if k != key})
    if not others:
        return ""
    return (f"; WARNING: it DISAGREES with {' and '.join(others)} beyond their paired bootstrap interval "
            "(see the warnings): do not trust either law alone")
