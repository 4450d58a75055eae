"""Synthetic runs from a known L(N, D), for tests, benchmarks and demos.

``isoflop_runs`` lays out an IsoFLOP-style grid (several budgets, N spread geometrically around
each budget's true optimum, or off-centre to make the profiles lopsided) with multiplicative
log-normal noise on the loss; ``continuous_runs`` draws N and D independently, so every run has
its own C, as in tables read off published plots; ``write_sweep`` writes runs as a sweep folder
following the lab's run-directory contract.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.published import LAWS

# Hoffmann et al.'s approach-3 fit, a handy ground truth.
CHINCHILLA = LAWS[0].as_dict()


def law_loss(n: np.ndarray, d: np.ndarray, law: dict[str, float] = CHINCHILLA) -> np.ndarray:
    """L(N, D) = E + A/N^alpha + B/D^beta."""
    return law["E"] + law["A"] / np.power(n, law["alpha"]) + law["B"] / np.power(d, law["beta"])


def law_optimum(flops: np.ndarray, law: dict[str, float] = CHINCHILLA) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form compute-optimal N and D under C = 6ND."""
    alpha, beta = law["alpha"], law["beta"]
    g = (alpha * law["A"] / (beta * law["B"])) ** (1.0 / (alpha + beta))
    c6 = np.asarray(flops, float) / 6.0
    return g * c6 ** (beta / (alpha + beta)), c6 ** (alpha / (alpha + beta)) / g


def isoflop_runs(budgets: np.ndarray, per_budget: int = 9, spread: float = 8.0, noise: float = 0.01,
                 seed: int = 0, law: dict[str, float] = CHINCHILLA, offset: float = 1.0) -> pd.DataFrame:
    """Runs at each budget with N from N_opt*offset/spread to N_opt*offset*spread (log-spaced).

    Loss is L(N, D) * exp(noise * z), z standard normal; D = C/(6N).
    """
    rng = np.random.default_rng(seed)
    budgets = np.asarray(budgets, float)
    n_opt, _ = law_optimum(budgets, law)
    factors = np.geomspace(offset / spread, offset * spread, per_budget)
    n = (n_opt[:, None] * factors[None, :]).ravel()
    flops = np.repeat(budgets, per_budget)
    d = flops / (6.0 * n)
    loss = law_loss(n, d, law) * np.exp(noise * rng.standard_normal(n.size))
    return pd.DataFrame({"run_id": [f"run{i:04d}" for i in range(n.size)], "params": n, "tokens": d,
                         "flops": flops, "loss": loss})


def continuous_runs(n_runs: int, params: tuple[float, float] = (1e7, 1e10), tokens: tuple[float, float] = (1e9, 1e11),
                    noise: float = 0.01, seed: int = 0, law: dict[str, float] = CHINCHILLA) -> pd.DataFrame:
    """Runs with N and D drawn log-uniformly in the given ranges; C = 6ND, loss as in isoflop_runs."""
    rng = np.random.default_rng(seed)
    n = np.exp(rng.uniform(*np.log(params), n_runs))
    d = np.exp(rng.uniform(*np.log(tokens), n_runs))
    loss = law_loss(n, d, law) * np.exp(noise * rng.standard_normal(n_runs))
    return pd.DataFrame({"run_id": [f"run{i:05d}" for i in range(n_runs)], "params": n, "tokens": d,
                         "flops": 6.0 * n * d, "loss": loss})


def write_sweep(runs: pd.DataFrame, root: Path, law: dict[str, float] = CHINCHILLA, records: int = 24,
                noise: float = 0.01, seed: int = 0) -> list[Path]:
    """Write each run as ``root/<run_id>/summary.json`` + ``metrics.jsonl``; returns the run dirs.

    Curves follow L(N, D_t) at the tokens D_t seen so far, with noise; eval records every third.
    """
    rng = np.random.default_rng(seed)
    dirs = []
    for run in runs.itertuples(index=False):
        run_dir = Path(root) / str(run.run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        tokens = np.geomspace(run.tokens / 50.0, run.tokens, records)
        train = law_loss(run.params, tokens, law) * np.exp(noise * rng.standard_normal(records))
        lines = []
        for step, (t, value) in enumerate(zip(tokens, train), 1):
            lines.append({"step": step, "tokens": float(t), "loss": float(value), "lr": 1e-3})
            if step == records:
                lines.append({"step": step, "tokens": float(t), "eval_loss": float(run.loss)})
            elif step % 3 == 0:
                eval_loss = law_loss(run.params, t, law) * np.exp(noise * rng.standard_normal())
                lines.append({"step": step, "tokens": float(t), "eval_loss": float(eval_loss)})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        summary = {"params": float(run.params), "params_non_embedding": float(run.params) * 0.9,
                   "tokens": float(run.tokens), "flops": float(run.flops), "final_train_loss": float(train[-1]),
                   "final_eval_loss": float(run.loss), "strategy": "ddp", "world_size": 1,
                   "wall_time_s": 1.0, "status": "completed"}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        dirs.append(run_dir)
    return dirs
