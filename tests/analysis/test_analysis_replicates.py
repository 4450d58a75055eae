"""Seed replicates (runs of one experiment with another seed) are the sweep's design, not unexplained duplicates:
a note gives their seed noise, the spline averages them, and `fit --drop-outliers` fits without flagged runs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis import akima
from analysis.cli import main
from analysis.synthetic import isoflop_runs
from analysis.table import load_runs

BUDGETS = (1e18, 3e18, 1e19)


def _with_repeat(experiment: bool, same: bool = True) -> pd.DataFrame:
    """Synthetic IsoFLOP runs, each its own experiment, plus a second seed of run 2, 2 % higher."""
    runs = isoflop_runs(BUDGETS, per_budget=5, spread=4, noise=0.01, seed=0)
    if experiment:
        runs["experiment"] = [f"e{i}" for i in range(len(runs))]
    repeat = runs.iloc[[2]].assign(run_id="run2-s1", loss=runs["loss"].iloc[2] * 1.02)
    if experiment and not same:
        repeat["experiment"] = "another"
    return pd.concat([runs, repeat], ignore_index=True)


@pytest.mark.parametrize("experiment, same, warned", [(True, True, False), (True, False, True), (False, True, True)])
def test_seed_replicates_are_noted_and_other_duplicates_warned(tmp_path, experiment, same, warned):
    path = tmp_path / "runs.csv"
    _with_repeat(experiment, same).to_csv(path, index=False)
    table = load_runs(path)
    assert len(table.runs) == 16  # kept, each its own point, either way
    assert [g["replicates"] for g in table.duplicates] == [not warned]
    assert any(code == "duplicates" for code, _ in table.warnings) == warned
    assert any("seed replicates" in note and "0.0" in note for note in table.notes) == (not warned)


def test_a_sweep_folders_runs_differing_only_in_seed_and_layout_are_one_experiment(tmp_path):
    def run(name: str, seed: int, strategy: str, lr: float) -> None:
        folder = tmp_path / "sweep" / name
        folder.mkdir(parents=True)
        summary = {"params": 1e6, "params_non_embedding": 9e5, "tokens": 2e7, "flops": 1.2e14,
                   "final_eval_loss": 3.0 + seed / 100, "status": "completed"}
        config = {"model": {"d_model": 64}, "train": {"seed": seed, "lr": lr}, "parallel": {"strategy": strategy},
                  "log": {"every": 10}}
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / "config.json").write_text(json.dumps(config))

    run("a", 1337, "single", 1e-3)
    run("a-s1", 1, "zero2", 1e-3)
    run("b", 1337, "single", 2e-3)
    from analysis.table import _read_sweep

    frame, _, _ = _read_sweep(tmp_path / "sweep", [])
    experiment = dict(zip(frame["run_id"], frame["experiment"]))
    assert experiment["a"] == experiment["a-s1"] != experiment["b"]


def test_the_spline_averages_an_experiments_seeds_and_takes_the_lowest_experiment():
    log_n = np.log([1e3, 1e3, 1e3, 2e3, 4e3])
    loss = np.array([3.0, 3.2, 3.5, 2.9, 3.1])
    sizes, seeds_averaged = akima.profile(log_n, loss, np.array([0, 0, 1, 2, 3]))
    assert np.allclose(sizes, np.log([1e3, 2e3, 4e3]))
    assert seeds_averaged.tolist() == pytest.approx([3.1, 2.9, 3.1])
    _, lowest = akima.profile(log_n, loss, np.array([0, 1, 2, 3, 4]))  # three experiments at 1e3: tuned settings
    assert lowest.tolist() == pytest.approx([3.0, 2.9, 3.1])
    assert akima.profile(log_n, loss)[1].tolist() == pytest.approx([3.0, 2.9, 3.1])  # no experiments: each its own
    # a resample's counts weight the replicates it drew; a size it drew no run of is missing (inf)
    weights = np.array([[2.0, 1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0, 1.0]])
    best = akima.size_losses(log_n, loss[None, :], weights, np.array([0, 0, 1, 2, 3]))
    assert best[0].tolist() == pytest.approx([(2 * 3.0 + 3.2) / 3, np.inf, 3.1])
    assert best[1].tolist() == pytest.approx([3.2, 2.9, 3.1])


@pytest.mark.slow
def test_fit_drop_outliers_refits_without_the_runs_the_first_fit_flags(tmp_path, capsys):
    runs = isoflop_runs(BUDGETS, per_budget=7, spread=4, noise=0.01, seed=1)
    runs.loc[5, "loss"] *= 1.25
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    args = ["fit", str(path), "--no-progress", "--workers", "1", "--bootstrap", "20", "--no-holdout"]
    main([*args, "--out", str(tmp_path / "all")])
    first = json.loads((tmp_path / "all" / "fit.json").read_text())
    flagged = [o["run_id"] for o in first["outliers"]["runs"]]
    assert str(runs.loc[5, "run_id"]) in flagged and any(w["code"] == "outliers" for w in first["warnings"])
    capsys.readouterr()
    main([*args, "--out", str(tmp_path / "kept"), "--drop-outliers"])
    out = capsys.readouterr().out
    assert f"dropped the {len(flagged)} run(s) the first fit flagged as outliers: {', '.join(flagged)}" in out
    doc = json.loads((tmp_path / "kept" / "fit.json").read_text())
    assert doc["data"]["n_runs"] == len(runs) - len(flagged)
    assert sorted(d["run_id"] for d in doc["dropped"]) == sorted(flagged)
    assert {d["reason"] for d in doc["dropped"]} == {"an outlier of the fit of every run (--drop-outliers)"}


def test_the_final_loss_frontier_averages_an_experiments_seeds():
    from analysis.envelope import build_frontier

    # one budget: size 1e3's two seeds average 3.1, above size 2e3's 3.05, though one seed alone is lower
    n = np.array([1e3, 1e3, 2e3])
    loss = np.array([3.0, 3.2, 3.05])
    c = np.full(3, 1e12)
    runs = np.ones((1, 3))
    seeds = build_frontier(c, n, c / (6 * n), loss, experiments=np.array([0, 0, 1]))
    assert [p["params"] for p in seeds.points()] == [2e3]
    assert [p["params"] for p in build_frontier(c, n, c / (6 * n), loss).points()] == [1e3]
    assert seeds.winners(np.array([[1.0, 0.0, 1.0]]))[0, seeds.rows.tolist().index(0)]  # seed 1 drawn alone: 3.0
    assert seeds.winners(runs).sum() == 1




def _replicated(disagree: float) -> pd.DataFrame:
    """Two seeds of every synthetic IsoFLOP run (1 % noise); at the smallest budget the three largest sizes (its
    shortest runs) have seeds that disagree, one ``disagree`` high and the other as much low."""
    runs = isoflop_runs(BUDGETS, per_budget=7, spread=4, noise=0.01, seed=2)
    runs["experiment"] = runs["run_id"]
    noise = np.exp(0.01 * np.random.default_rng(3).standard_normal(len(runs)))
    second = runs.assign(run_id=runs["run_id"] + "-s1", loss=runs["loss"] * noise)
    short = [4, 5, 6]  # budget 1e18's largest sizes
    runs.loc[short, "loss"] /= 1 + disagree
    second.loc[short, "loss"] *= 1 + disagree
    return pd.concat([runs, second], ignore_index=True)


def test_outliers_are_judged_on_experiments_when_runs_have_seed_replicates(tmp_path):
    from analysis.fit import FitConfig, find_outliers, fit_runs

    def table(frame: pd.DataFrame, name: str):
        frame.to_csv(tmp_path / name, index=False)
        return load_runs(tmp_path / name)

    law = fit_runs(table(_replicated(0.0), "clean.csv"), FitConfig(n_bootstrap=0, progress=False, holdout=False))
    theta, form = law.parametric.theta, law.parametric.form
    runs = _replicated(0.06)
    # the disagreeing seeds average on the law: seed noise the replicates show, no outlier of the law
    found = find_outliers(table(runs, "seeds.csv"), theta, form)
    assert found["runs"] == [] and found["replicates_averaged"]
    # the same numbers without the experiment column: every run its own point, and the stray seeds are outliers
    alone = find_outliers(table(runs.drop(columns="experiment"), "alone.csv"), theta, form)
    assert not alone["replicates_averaged"]
    strays = {f"run{i:04d}{s}" for i in (4, 5, 6) for s in ("", "-s1")}
    assert {o["run_id"] for o in alone["runs"]} == strays
    # an experiment whose both seeds are off the law is flagged, with both its runs
    both = runs.copy()
    both.loc[both["run_id"].isin(["run0010", "run0010-s1"]), "loss"] *= 1.1
    assert {o["run_id"] for o in find_outliers(table(both, "both.csv"), theta, form)["runs"]} == {"run0010",
                                                                                                  "run0010-s1"}


@pytest.mark.slow  # a few seconds: `make test`, not the edit loop
def test_approach_3_counts_each_experiment_once_however_many_seeds_it_has(tmp_path):
    from analysis.fit import FitConfig, fit_runs

    def theta(frame: pd.DataFrame, name: str) -> np.ndarray:
        frame.to_csv(tmp_path / name, index=False)
        result = fit_runs(load_runs(tmp_path / name), FitConfig(n_bootstrap=0, progress=False, holdout=False))
        return result.parametric.theta

    runs = isoflop_runs(BUDGETS, per_budget=7, spread=4, noise=0.01, seed=4).assign(experiment=lambda r: r["run_id"])
    small = runs[runs["flops"] == BUDGETS[0]]
    copies = pd.concat([small.assign(run_id=small["run_id"] + f"-s{k}") for k in (1, 2)])
    tripled = pd.concat([runs, copies], ignore_index=True)  # the smallest budget's runs three times, same losses
    once = theta(runs, "once.csv")
    # as seeds of their experiments they weigh what one run did: the same objective, the same law
    np.testing.assert_allclose(theta(tripled, "seeds.csv"), once, rtol=1e-5, atol=1e-8)
    # as runs of their own they weigh three times, and the law moves
    assert not np.allclose(theta(tripled.drop(columns="experiment"), "runs.csv"), once, rtol=1e-3)
