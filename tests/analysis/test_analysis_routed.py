"""The routed models' law recovers the parameters that made its data, plans by budget, and refuses what it can't fit."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis.cli import main
from analysis.routed import RoutedError, fit_routed, plan_budgets

L_INF, B, ALPHA, BETA = 1.7, 900.0, 0.34, 0.30
A = {(0, 1, 1): 400.0, (8, 1, 1): 250.0, (8, 2, 2): 210.0}  # dense, E8 top-1, E8 top-2 at granularity 2


def law_runs(noise: float, seed: int = 1, configs: dict = A) -> pd.DataFrame:
    """IsoFLOP-like runs of each configuration made by the law, with lognormal noise on the loss."""
    rng = np.random.default_rng(seed)
    rows = []
    for (experts, top_k, granularity), a in configs.items():
        for n in np.geomspace(1e4, 1e6, 5):
            for d in np.geomspace(1e6, 1e8, 4):
                loss = (L_INF + a / n ** ALPHA + B / d ** BETA) * np.exp(rng.normal(0, noise))
                rows.append({"run_id": f"E{experts}-{n:.0f}-{d:.0f}", "params": n * (1 + experts), "params_active": n,
                             "tokens": d, "flops": 6.5 * n * d, "flops_per_token": 6.5 * n, "loss": loss,
                             "moe_experts": experts, "moe_top_k": top_k, "moe_granularity": granularity})
    return pd.DataFrame(rows)


@pytest.mark.slow  # a fit of several seconds: in `make test`, not the edit loop
def test_the_law_recovers_the_parameters_that_made_its_runs_within_its_intervals():
    fit = fit_routed(law_runs(noise=0.003), n_resamples=60)
    named = fit.named()
    truth = {"A[dense]": 400.0, "A[E8 k1 G1]": 250.0, "A[E8 k2 G2]": 210.0, "B": B, "L_inf": L_INF, "alpha": ALPHA,
             "beta": BETA}
    for name, value in truth.items():
        lo, hi = fit.interval_of(lambda th, name=name: fit.named(th)[name])
        assert lo <= value <= hi, (name, value, lo, hi)
        assert named[name] == pytest.approx(value, rel=0.1)
    # E8 top-1 is worth (400/250)^(1/0.34) = 3.98 dense parameters per active one
    assert fit.multiplier("E8 k1 G1") == pytest.approx((400 / 250) ** (1 / ALPHA), rel=0.05)
    exact = fit_routed(law_runs(noise=0.0), n_resamples=0)
    assert exact.rmse_log < 1e-6 and exact.named()["alpha"] == pytest.approx(ALPHA, rel=1e-4)
    assert not fit.notes  # every interval within a factor 10
    runs = law_runs(noise=0.05)  # noisier runs over a 10-fold corner of the grid: the power terms are loose
    loose = fit_routed(runs[(runs.params_active <= 1.1e5) & (runs.tokens <= 2.2e7)], n_resamples=30)
    assert any("interval spans more than a factor 10" in note for note in loose.notes), loose.notes


def test_the_plan_is_each_configurations_compute_optimum_and_marks_the_lowest():
    fit = fit_routed(law_runs(noise=0.0), n_resamples=20)
    budget = 1e15
    rows = plan_budgets(fit, [budget])
    assert [r["configuration"] for r in rows] == ["dense", "E8 k1 G1", "E8 k2 G2"]
    for r in rows:  # the optimum along C = f·N·D, found by brute force over N
        n = np.geomspace(1e3, 1e10, 200_001)
        loss = fit.predict(r["configuration"], n, budget / 6.5 / n)
        assert r["n_active"] == pytest.approx(n[np.argmin(loss)], rel=1e-3)
        assert r["loss"] == pytest.approx(loss.min(), rel=1e-9)
    assert [r.get("best", False) for r in rows] == [False, False, True]  # the smallest A wins at equal active compute


def test_runs_the_law_cannot_identify_are_refused_in_one_line():
    runs = law_runs(noise=0.0)
    with pytest.raises(RoutedError, match="one routing configuration"):
        fit_routed(runs[runs.moe_experts == 0])
    one_size = runs[(runs.moe_experts == 0) | (runs.params_active == runs.params_active.min())]
    with pytest.raises(RoutedError, match="runs of one size only"):
        fit_routed(one_size)
    with pytest.raises(RoutedError, match="lack column"):
        fit_routed(runs.drop(columns="moe_top_k"))


def test_the_command_writes_the_law_the_plan_and_a_figure(tmp_path, capsys):
    table = tmp_path / "runs.csv"
    law_runs(noise=0.002, configs={k: A[k] for k in list(A)[:2]}).to_csv(table, index=False)
    assert main(["routed", str(table), "--out", str(tmp_path / "out"), "--bootstrap", "20", "--predict", "1e15"]) == 0
    out = capsys.readouterr().out
    assert "E8 k1 G1 is worth" in out and "<- lowest" in out
    doc = json.loads((tmp_path / "out" / "routed.json").read_text())
    assert doc["multipliers"]["E8 k1 G1"]["value"] == pytest.approx(3.98, rel=0.1)
    assert (tmp_path / "out" / "routed.png").stat().st_size > 10_000
    dense_only = tmp_path / "dense.csv"
    law_runs(noise=0.0, configs={(0, 1, 1): 400.0}).to_csv(dense_only, index=False)
    assert main(["routed", str(dense_only), "--out", str(tmp_path / "no")]) == 2
    assert capsys.readouterr().err.startswith("error: all 20 runs have one routing configuration (dense)")
    assert not (tmp_path / "no").exists()


@pytest.mark.slow  # a fit of several seconds: in `make test`, not the edit loop
def test_on_the_recorded_default_moe_sweep_both_routings_beat_dense_at_equal_active_compute():
    """sweeps/tiny_moe.toml's 45 runs (2026-11-26): each routing's multiplier over dense is above 1 with its interval,
    and at every budget the lowest loss of each routing is below dense's; the power terms are flagged as loose."""
    from pathlib import Path

    runs = pd.read_csv(Path(__file__).parent / "data" / "moe-sweep.csv")
    fit = fit_routed(runs, n_resamples=100)
    for config in ("E4 k1 G1", "E8 k2 G2"):
        lo, _ = fit.interval_of(lambda th, c=config: fit.multiplier(c, theta=th))
        assert fit.multiplier(config) > 1 and lo > 1, (config, fit.multiplier(config), lo)
    best = runs.groupby(["budget", "moe_experts"])["loss"].min().unstack()
    assert (best[4] < best[0]).all() and (best[8] < best[0]).all()
    assert any("interval spans more than a factor 10" in note for note in fit.notes)
