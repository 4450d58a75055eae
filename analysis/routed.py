"""Routed models' law: L = L_inf + A_k / N^alpha + B / D^beta, one A_k per routing configuration k.

Krajewski et al. (2024) fit fine-grained mixtures of experts with Chinchilla's form whose N coefficient depends on
the routing (their granularity G: A(G) = a + g / G^gamma), the floor and both exponents shared. Here the coefficient
is left free per configuration (experts E, top-k, granularity G; the dense model is one of them), so a sweep may
vary E and G together; N is the active parameter count, D the tokens. What one configuration buys over another
is then a constant factor on the active parameters: at any D, configuration k reaches the loss a configuration j
model ``(A_j / A_k)^(1/alpha)`` times its active size would (Clark et al. 2022's "effective parameter count", here
without their N × E interaction, which a common alpha rules out; stated in the report).

Compute-optimal per configuration is Chinchilla's allocation with A_k along C = f_k · N · D, f_k the
configuration's training FLOPs per active parameter and token (6 plus attention and router terms, from the runs);
``plan`` picks, at each budget, the configuration with the lowest predicted loss and says whether the next one's
interval overlaps it.

``fit_routed`` is a pure function of a table of runs; bootstrap intervals resample runs within each configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from analysis import robust
from analysis.bootstrap import interval
from analysis.robust import HUBER_DELTA
from lab.measure.laws import CHINCHILLA

DENSE = "dense"
REQUIRED = ("params_active", "tokens", "flops", "loss", "flops_per_token", "moe_experts", "moe_top_k",
            "moe_granularity")


class RoutedError(ValueError):
    """Runs the routed law cannot be fitted to; the message is one line."""


def configuration(experts: int, top_k: int, granularity: int) -> str:
    """The label of a routing configuration: 'dense', or 'E8 k2 G1'."""
    return DENSE if experts == 0 else f"E{experts} k{top_k} G{granularity}"


def labels_of(runs: pd.DataFrame) -> pd.Series:
    """Each run's configuration label (columns moe_experts, moe_top_k, moe_granularity)."""
    return runs.apply(lambda r: configuration(int(r.moe_experts), int(r.moe_top_k), int(r.moe_granularity)), axis=1)


@dataclass
class RoutedFit:
    """The fitted law, its bootstrap samples and what it predicts per configuration."""

    configurations: list[str]  # in the order of theta's A_k
    theta: np.ndarray  # (log A_1..log A_K, log B, log L_inf, alpha, beta)
    samples: np.ndarray  # bootstrap thetas (S, K + 4)
    flops_per_param_token: dict[str, float]  # f_k: training FLOPs per active parameter per token
    runs: int
    rmse_log: float  # of the fit, in log loss
    level: float = 0.95
    notes: list[str] = field(default_factory=list)

    def named(self, theta: np.ndarray | None = None) -> dict[str, float]:
        th = self.theta if theta is None else theta
        k = len(self.configurations)
        out = {f"A[{c}]": float(np.exp(th[i])) for i, c in enumerate(self.configurations)}
        out.update(B=float(np.exp(th[k])), L_inf=float(np.exp(th[k + 1])), alpha=float(th[k + 2]),
                   beta=float(th[k + 3]))
        return out

    def predict(self, config: str, n: np.ndarray, d: np.ndarray, theta: np.ndarray | None = None) -> np.ndarray:
        """Loss of configuration ``config`` at active size ``n`` and tokens ``d``."""
        th = self.theta if theta is None else theta
        x, y = np.broadcast_arrays(np.log(n), np.log(d))
        group = np.full(x.size, self.configurations.index(config))
        return np.exp(_log_loss_jac(th, group, x.ravel(), y.ravel(), len(self.configurations))[0]).reshape(x.shape)

    def multiplier(self, config: str, reference: str = DENSE, theta: np.ndarray | None = None) -> float:
        """How many times its active size a ``reference`` model must be to match ``config`` at equal tokens."""
        th = self.theta if theta is None else theta
        i, j = self.configurations.index(config), self.configurations.index(reference)
        return float(np.exp((th[j] - th[i]) / th[len(self.configurations) + 2]))

    def optimal(self, config: str, flops: float, theta: np.ndarray | None = None) -> tuple[float, float, float]:
        """(N_opt active, D_opt, loss) of ``config`` at training budget ``flops`` (NaN without an optimum)."""
        th = self.theta if theta is None else theta
        k = len(self.configurations)
        i = self.configurations.index(config)
        alpha, beta = th[k + 2], th[k + 3]
        if alpha <= 0 or beta <= 0:
            return float("nan"), float("nan"), float("nan")
        budget = flops / self.flops_per_param_token[config]  # N · D
        log_g = (np.log(alpha / beta) + th[i] - th[k]) / (alpha + beta)
        n = float(np.exp(log_g + beta / (alpha + beta) * np.log(budget)))
        d = budget / n
        return n, d, float(self.predict(config, np.array(n), np.array(d), th))

    def interval_of(self, value: Callable[[np.ndarray], float]) -> list[float] | None:
        """The bootstrap interval of ``value(theta)``."""
        return interval(np.array([value(s) for s in self.samples]), self.level)


def _log_loss_jac(th: np.ndarray, group: np.ndarray, x: np.ndarray, y: np.ndarray, k: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Chinchilla's form (``lab.measure.laws``) at each run's own A: its log loss and Jacobian (runs, k + 4)."""
    pred, jac = CHINCHILLA.log_loss_jac((th[group], *th[k:]), x, y)
    full = np.zeros((len(x), len(th)))
    full[np.arange(len(x)), group] = jac[:, 0]
    full[:, k:] = jac[:, 1:]
    return pred, full


def _problem(group: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, k: int,
             delta: float | None = HUBER_DELTA) -> robust.Problem:
    """The engine's problem (plain least squares with ``delta`` None)."""
    return robust.Problem(lambda th: _log_loss_jac(th, group, x, y, k), log_loss, delta, scale="jac")


def _starts(group: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, k: int) -> list[np.ndarray]:
    """Starting points: each exponent pair of a small grid, the floor at a share of the lowest loss, each power term
    half of the mean gap above the floor at the runs' mean size and tokens."""
    out = []
    for share in (0.2, 0.5, 0.8):
        floor = log_loss.min() + np.log(share)
        half_gap = [np.log(0.5 * max(np.exp(log_loss[group == i]).mean() - np.exp(floor), 1e-6)) for i in range(k)]
        for alpha in (0.2, 0.5, 1.0):
            for beta in (0.2, 0.5, 1.0):
                a = [g + alpha * x[group == i].mean() for i, g in enumerate(half_gap)]
                out.append(np.array([*a, np.mean(half_gap) + beta * y.mean(), floor, alpha, beta]))
    return out


def check_runs(runs: pd.DataFrame) -> None:
    """Raise RoutedError (one line) when the runs cannot identify the law."""
    missing = [c for c in REQUIRED if c not in runs.columns]
    if missing:
        raise RoutedError(f"the runs lack column(s) {', '.join(missing)} (export them with python -m sweeps export)")
    labels = labels_of(runs)
    if labels.nunique() < 2:
        raise RoutedError(f"all {len(runs)} runs have one routing configuration ({labels.iloc[0]}); the routed law "
                          f"compares two or more (dense among them)")
    for label, part in runs.groupby(labels):
        if part["params_active"].nunique() < 2:
            raise RoutedError(f"configuration {label} has runs of one size only: its A cannot be told from the floor")
    if runs["tokens"].nunique() < 2:
        raise RoutedError("every run saw the same tokens: D's exponent is not identified")
    if len(runs) < len(labels.unique()) + 5:
        raise RoutedError(f"{len(runs)} runs for {len(labels.unique()) + 4} parameters: need at least one more run")


def fit_routed(runs: pd.DataFrame, n_resamples: int = 200, seed: int = 0, level: float = 0.95) -> RoutedFit:
    """Fit the law to ``runs`` (columns ``REQUIRED``), with bootstrap intervals over runs within configurations."""
    check_runs(runs)
    labels = labels_of(runs).to_numpy()
    configurations = sorted(set(labels), key=lambda c: (c != DENSE, c))
    k = len(configurations)
    group = np.array([configurations.index(c) for c in labels])
    x, y = np.log(runs["params_active"].to_numpy(float)), np.log(runs["tokens"].to_numpy(float))
    log_loss = np.log(runs["loss"].to_numpy(float))
    # least squares first (Huber's linear tails crawl from far away), then Huber from there
    plain = [robust.solve(_problem(group, x, y, log_loss, k, None), s) for s in _starts(group, x, y, log_loss, k)]
    problem = _problem(group, x, y, log_loss, k)
    theta = robust.fit(problem, [p.x for p in plain])[0].x
    rng = np.random.default_rng(seed)
    members = [np.flatnonzero(group == i) for i in range(k)]
    counts = np.array([np.bincount(np.concatenate([rng.choice(m, size=len(m)) for m in members]), minlength=len(x))
                       for _ in range(n_resamples)]).reshape(n_resamples, len(x))
    samples = robust.refit(problem, theta, counts)[0]
    per_token = runs["flops_per_token"].to_numpy(float) / runs["params_active"].to_numpy(float)
    f = {c: float(np.median(per_token[group == i])) for i, c in enumerate(configurations)}
    rmse = float(np.sqrt(np.mean((_log_loss_jac(theta, group, x, y, k)[0] - log_loss) ** 2)))
    fit = RoutedFit(configurations, theta, samples, f, len(runs), rmse, level)
    if DENSE not in configurations:
        fit.notes.append("no dense runs: multipliers are relative to the first configuration")
    loose = [name for name in fit.named() if name != "L_inf" and _spread(fit, name) > LOOSE_SPREAD]
    if loose:
        fit.notes.append(f"{', '.join(loose)}: the {100 * level:.0f} % interval spans more than a factor "
                         f"{LOOSE_SPREAD:g}: these runs do not pin the power terms down, so losses far outside "
                         f"their budgets are guesses (the multipliers, ratios of A's fitted on the same runs, "
                         f"have intervals of their own)")
    return fit


LOOSE_SPREAD = 10.0  # a parameter whose interval's ends differ by more than this factor is not pinned down


def _spread(fit: RoutedFit, name: str) -> float:
    """The ratio of a named parameter's interval ends (exponents: of 1 + the value, as a loss term's power moves)."""
    iv = fit.interval_of(lambda th: fit.named(th)[name])
    if iv is None:
        return 1.0
    lo, hi = (1 + iv[0], 1 + iv[1]) if name in ("alpha", "beta") else iv
    return float("inf") if lo <= 0 else hi / lo


def plan_budgets(fit: RoutedFit, budgets: list[float]) -> list[dict]:
    """Per budget and configuration: N_opt (active), D_opt and loss with intervals; the best marked."""
    rows = []
    for c_flops in budgets:
        options = []
        for config in fit.configurations:
            n, d, loss = fit.optimal(config, c_flops)
            options.append({"budget": c_flops, "configuration": config, "n_active": n, "tokens": d, "loss": loss,
                            "loss_interval": fit.interval_of(lambda th, c=config: fit.optimal(c, c_flops, th)[2]),
                            "n_interval": fit.interval_of(lambda th, c=config: fit.optimal(c, c_flops, th)[0])})
        finite = [o for o in options if np.isfinite(o["loss"])]
        if finite:
            best = min(finite, key=lambda o: o["loss"])
            best["best"] = True
            rest = [o for o in finite if o is not best]
            if rest:
                runner = min(rest, key=lambda o: o["loss"])
                lo = best["loss_interval"][1] if best["loss_interval"] else best["loss"]
                hi = runner["loss_interval"][0] if runner["loss_interval"] else runner["loss"]
                best["separated"] = bool(lo < hi)
        rows += options
    return rows


def to_dict(fit: RoutedFit, plan: list[dict]) -> dict:
    """What routed.json holds: the law with intervals, each configuration's multiplier over dense, the plan."""
    samples = [fit.named(th) for th in fit.samples]
    reference = fit.configurations[0]
    return {
        "law": "L = L_inf + A_k / N_active^alpha + B / D^beta (Krajewski et al. 2024's form, A_k free per routing "
               "configuration)",
        "runs": fit.runs, "rmse_log_loss": fit.rmse_log, "level": fit.level, "resamples": len(fit.samples),
        "parameters": {k: {"value": v, "interval": interval(np.array([s[k] for s in samples]), fit.level)}
                       for k, v in fit.named().items()},
        "multiplier_reference": reference,
        "multipliers": {c: {"value": fit.multiplier(c, reference),
                            "interval": fit.interval_of(lambda th, c=c: fit.multiplier(c, reference, th))}
                        for c in fit.configurations[1:]},
        "flops_per_param_token": fit.flops_per_param_token, "plan": plan, "notes": fit.notes,
    }


def describe(doc: dict) -> list[str]:
    """The terminal's lines: the law, the multipliers and the plan per budget."""
    def span(entry: dict, fmt: str) -> str:
        iv = entry.get("interval")
        return f"{entry['value']:{fmt}}" + (f" [{iv[0]:{fmt}}, {iv[1]:{fmt}}]" if iv else "")

    lines = [f"{doc['law']}: {doc['runs']} runs, RMSE of log loss {doc['rmse_log_loss']:.4f}, "
             f"{100 * doc['level']:.0f} % intervals from {doc['resamples']} resamples"]
    lines += [f"  {k:<22} {span(v, '.4g')}" for k, v in doc["parameters"].items()]
    lines += [f"  {c} is worth {span(m, '.3g')} × its active parameters in {doc['multiplier_reference']} models"
              for c, m in doc["multipliers"].items()]
    for budget in sorted({row["budget"] for row in doc["plan"]}):
        rows = [r for r in doc["plan"] if r["budget"] == budget]
        lines.append(f"budget {budget:.3g} FLOPs:")
        for r in rows:
            iv = r["loss_interval"]
            mark = "  <- lowest" + ("" if r.get("separated") else " (the next one's interval overlaps)") \
                if r.get("best") else ""
            lines.append(f"  {r['configuration']:<12} N_active {r['n_active']:.3g}, D {r['tokens']:.3g}, loss "
                         f"{r['loss']:.4f}" + (f" [{iv[0]:.4f}, {iv[1]:.4f}]" if iv else "") + mark)
    lines += [f"note: {n}" for n in doc["notes"]]
    return lines


def figure(fit: RoutedFit, runs: pd.DataFrame, budgets: list[float]):
    """Left: observed against predicted loss per configuration. Right: the compute-optimal loss per configuration
    along the budgets, with its bootstrap band, and the runs' own (C, loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (parity, frontier) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = labels_of(runs)
    grid = np.geomspace(min([*budgets, runs["flops"].min()]), max([*budgets, runs["flops"].max()]), 40)
    for i, config in enumerate(fit.configurations):
        part = runs[labels == config]
        colour = f"C{i}"
        predicted = fit.predict(config, part["params_active"].to_numpy(float), part["tokens"].to_numpy(float))
        parity.scatter(predicted, part["loss"], s=14, color=colour, label=config)
        best = np.array([fit.optimal(config, c)[2] for c in grid])
        band = np.array([[fit.optimal(config, c, th)[2] for c in grid] for th in fit.samples])
        frontier.plot(grid, best, color=colour, label=f"{config}: compute-optimal (law)")
        if len(band):
            lo, hi = np.nanpercentile(band, [50 * (1 - fit.level), 100 - 50 * (1 - fit.level)], axis=0)
            frontier.fill_between(grid, lo, hi, color=colour, alpha=0.2, lw=0)
        frontier.scatter(part["flops"], part["loss"], s=10, color=colour, alpha=0.6)
    lims = [runs["loss"].min() * 0.98, runs["loss"].max() * 1.02]
    parity.plot(lims, lims, "k--", lw=0.8)
    parity.set(xlabel="predicted loss", ylabel="observed loss", title="the law against the runs")
    parity.legend(fontsize=8)
    frontier.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="loss",
                 title="compute-optimal loss per routing configuration")
    frontier.legend(fontsize=8)
    fig.tight_layout()
    return fig
