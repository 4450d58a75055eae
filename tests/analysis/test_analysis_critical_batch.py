"""The critical batch: steps to a target from an eval curve, the frontier, its laws and the planner's use of them,
each held to data generated from known parameters in the test."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis import critical_batch as cb
from analysis.allocate import batch_plan, plan
from analysis.cli import main
from analysis.critical_batch_report import load_points
from test_analysis_planner import _fit

# S_min(L) = S0 (L / 2)^-P steps and E_min(L) = E0 (L / 2)^-Q tokens: B_crit(L) = (E0 / S0) (L / 2)^(P - Q), Kaplan's
# form with B* = (E0 / S0) 2^(Q - P) and alpha_B = 1 / (Q - P)
S0, E0, P, Q = 300.0, 6e5, 1.0, 4.0
B_STAR, ALPHA_B = E0 / S0 * 2 ** (Q - P), 1 / (Q - P)
BATCHES = [256, 512, 1024, 2048, 4096, 8192]
TARGETS = [2.4, 2.2, 2.0, 1.9, 1.8]


def b_crit(loss: float) -> float:
    return B_STAR * loss ** (-1 / ALPHA_B)


def curve(batch: float, steps: np.ndarray, slow: float = 1.0, scale: float = 1.0) -> np.ndarray:
    """The loss at ``steps`` of a run whose steps to every loss are ``slow`` x S_min(L) (1 + B_crit(L) / B)."""
    losses = np.geomspace(1.5, 5.0, 4000)
    needed = slow * scale * (S0 * (losses / 2) ** -P + E0 / batch * (losses / 2) ** -Q)  # falls as L rises
    return np.interp(np.log(steps), np.log(needed[::-1]), losses[::-1])


def points(sizes=((2e4, 1.0), (3e4, 0.8)), part: str = cb.GRID, noise: float = 0.03, seed: int = 0,
           rates=(0.5, 1.0, 2.0), noise_scale: bool = False) -> pd.DataFrame:
    """Eval points of a batch sweep on the law above: each run's steps off by its own factor exp(N(0, noise)), the
    middle rate the best (the others 1.3x slower); ``noise_scale``: a record of 10 x step at every eval."""
    rng = np.random.default_rng(seed)
    steps = np.unique(np.geomspace(10, 30000, 90).round())
    rows = []
    for params, scale in sizes:
        for batch in BATCHES:
            for rate in rates:
                slow = (1.0 if rate == 1.0 else 1.3) * math.exp(rng.normal(0, noise))
                losses = curve(batch, steps, slow, scale)
                rows += [{"run_id": f"{part}-{params:g}-{batch}-{rate}", "part": part, "params": params,
                          "batch_tokens": batch, "lr": rate, "seed": 0, "step": int(s), "eval_loss": loss,
                          "noise_scale": 10.0 * s if noise_scale else math.nan} for s, loss in zip(steps, losses)]
    return pd.DataFrame(rows)


def test_steps_to_a_target_are_exact_on_a_curve_linear_in_log_steps():
    steps = np.array([10, 20, 40, 80, 160, 320])
    losses = 3.0 - 0.25 * np.log(steps)
    assert cb.steps_to_target(steps, losses, 2.0) == pytest.approx(math.exp(4.0), rel=1e-12)
    assert cb.steps_to_target(steps, losses, 3.0 - 0.25 * math.log(80)) == pytest.approx(80, rel=1e-12)
    assert math.isnan(cb.steps_to_target(steps, losses, 1.0))  # never reached
    assert math.isnan(cb.steps_to_target(steps, losses, 2.9))  # reached before the first evaluation
    bumpy = losses.copy()
    bumpy[2] -= 0.2  # a lucky dip below the next evaluation: pooled with it, not taken as the crossing
    pooled = (bumpy[2] + bumpy[3]) / 2
    assert cb.steps_to_target(steps, bumpy, pooled) == pytest.approx(40, rel=1e-12)
    assert cb.steps_to_target(steps, bumpy, bumpy[2]) > 40


def test_zhangs_batch_is_where_the_tokens_first_exceed_the_fewest_by_a_fifth():
    batch = np.array([1.0, 2.0, 4.0, 8.0])
    tokens = np.array([1.0, 1.1, 1.3, 2.0])
    share = (math.log(1.2) - math.log(1.1)) / (math.log(1.3) - math.log(1.1))
    assert cb.zhang_batch(batch, tokens) == pytest.approx(2 * 2 ** share, rel=1e-12)
    assert math.isnan(cb.zhang_batch(batch, np.array([1.0, 1.05, 1.1, 1.15])))


def test_the_frontier_recovers_a_known_critical_batch_inside_its_interval():
    batch = np.array(BATCHES, float)
    s_min, e_min = 200.0, 8e5
    exact = cb.FrontierPoints("grid", 1e4, 2.0, batch, s_min + e_min / batch, np.ones(6), np.zeros(6, bool),
                              np.full(6, np.nan))
    fit = cb.fit_frontier(exact, n_resamples=20)
    assert (fit.s_min, fit.e_min) == pytest.approx((s_min, e_min), rel=1e-6)
    covered = 0
    for seed in range(5):
        noisy = np.exp(np.random.default_rng(seed).normal(0, 0.04, 6)) * (s_min + e_min / batch)
        fit = cb.fit_frontier(cb.FrontierPoints("grid", 1e4, 2.0, batch, noisy, np.ones(6), np.zeros(6, bool),
                                                np.full(6, np.nan)), n_resamples=200, seed=seed)
        lo, hi = fit.ci(fit.b_crit_samples())
        covered += lo <= e_min / s_min <= hi
        assert fit.b_crit == pytest.approx(e_min / s_min, rel=0.5)
    assert covered >= 4


def test_the_analysis_recovers_the_law_and_verifies_a_held_out_size():
    table = pd.concat([points(), points(sizes=((6e4, 0.6),), part=cb.HELD_OUT, seed=1)])
    doc = cb.analyse(table, {cb.GRID: TARGETS, cb.HELD_OUT: [1.8, 1.7]}, n_resamples=100)
    grid = [f for f in doc["frontiers"] if f["part"] == cb.GRID]
    assert len(grid) == 2 * len(TARGETS)
    for f in grid:
        assert f["b_crit"] == pytest.approx(b_crit(f["target"]), rel=0.25)
        assert all(p["lr"] == 1.0 and not p["lr_at_edge"] for p in f["points"])  # each batch at its best rate
        assert f["noise_scale"] is None  # not measured
    law = doc["laws"]["loss"]
    assert law["B_star_ci"][0] <= B_STAR <= law["B_star_ci"][1] and law["B_star"] == pytest.approx(B_STAR, rel=0.2)
    assert law["alpha_B_ci"][0] <= ALPHA_B <= law["alpha_B_ci"][1]
    assert law["alpha_B"] == pytest.approx(ALPHA_B, rel=0.1)
    zhang = doc["laws"]["tokens_size"]
    assert zhang["columns"][-1] == "b_N (size)"
    for p in doc["prediction"]:
        assert p["within"] and p["ratio"] == pytest.approx(1.0, abs=0.3)
        assert p["predicted"] == pytest.approx(b_crit(p["target"]), rel=0.2)


def test_the_noise_scale_is_read_at_the_step_each_run_reaches_the_target():
    table = points(sizes=((2e4, 1.0),), noise=0.0, noise_scale=True, rates=(1.0,))
    doc = cb.analyse(table, {cb.GRID: [2.2, 2.0, 1.8]}, n_resamples=0)
    for f in doc["frontiers"]:
        for p in f["points"]:
            assert p["noise_scale"] == pytest.approx(10 * p["steps"], rel=0.02)  # 10 x step, read in log steps


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.drop(columns="lr"), "the table lacks column(s) lr"),
    (lambda t: t[t["batch_tokens"] <= 512], "the grid's runs have 2 batch size(s); the frontier needs 3"),
])
def test_bad_tables_fail_with_one_line(edit, message):
    with pytest.raises(cb.CriticalBatchError) as info:
        cb.analyse(edit(points(sizes=((2e4, 1.0),), rates=(1.0,))), {cb.GRID: TARGETS}, n_resamples=0)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_target_no_run_reaches_is_refused_before_any_fit():
    with pytest.raises(cb.CriticalBatchError, match=r"target 1.2 is reached by no run of the grid part"):
        cb.analyse(points(sizes=((2e4, 1.0),), rates=(1.0,)), {cb.GRID: [2.0, 1.2]})
    with pytest.raises(cb.CriticalBatchError, match="no target losses for the grid"):
        cb.analyse(points(sizes=((2e4, 1.0),), rates=(1.0,)), {cb.GRID: []})


def test_the_planner_says_the_critical_batch_and_the_width_it_allows():
    law = {"theta": [math.log(B_STAR), -1 / ALPHA_B], "samples": [], "losses": [1.8, 2.4], "level": 0.95}
    b = batch_plan(law, 2.0, 64, 256)
    assert b.b_crit == pytest.approx(b_crit(2.0), rel=1e-12)
    assert b.width == int(b_crit(2.0) // 256) and b.width * 256 <= b.b_crit < (b.width + 1) * 256
    for row in b.widths:
        batch = row["gpus"] * 256
        assert (row["steps"], row["tokens"]) == pytest.approx((1 + b.b_crit / batch, 1 + batch / b.b_crit))
    at_width = next(r for r in b.widths if r["gpus"] == b.width)
    assert at_width["tokens"] <= 2 < next(r for r in b.widths if r["gpus"] == 2 * b.width)["tokens"]  # near-linear


def test_analysis_critical_batch_and_plan_from_the_command_line(tmp_path, capsys):
    table = points(sizes=((2e4, 1.0),), rates=(1.0,))
    table.to_csv(tmp_path / "points.csv", index=False)
    out = tmp_path / "out"
    code = main(["critical-batch", str(tmp_path / "points.csv"), "--out", str(out), "--targets", *map(str, TARGETS),
                 "--bootstrap", "50"])
    printed = capsys.readouterr().out
    assert code == 0 and "law: B_crit(L) = " in printed and "noise scale not measured" in printed
    assert sorted(p.name for p in out.iterdir()) == ["bcrit.png", "critical_batch.json", "frontier.png", "points.csv",
                                                     "report.md"]
    again, targets, _ = load_points(out / "points.csv")  # the points it writes read back as they were
    assert len(again) == len(table) and targets[cb.GRID] == []
    (tmp_path / "fit.json").write_text(json.dumps(_fit()))
    assert main(["plan", str(tmp_path / "fit.json"), "--gpu", "H100", "--n-gpus", "8", "--mfu", "0.4", "--flops",
                 "1e22", "--critical-batch", str(out / "critical_batch.json"), "--per-gpu-batch", "512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    critical = next(line for line in lines if line.startswith("critical "))
    loss = plan(_fit(), "H100", 8, 0.4, flops=1e22).loss
    assert f"at loss {loss:.4g}" in critical and "(law fitted at L 1.8-2.4: inside)" in critical
    assert any(line.startswith("data par.   at 512 tokens per GPU, up to ") for line in lines)
    assert any(line.rstrip().endswith("<- the plan") for line in lines)
    assert main(["critical-batch", str(tmp_path / "points.csv"), "--out", str(out), "--targets", "0.5"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: target 0.5 is reached by no run")


def test_a_sweep_folder_gives_each_completed_runs_points_its_part_and_the_targets(tmp_path):
    table = points(sizes=((2e4, 1.0),), rates=(1.0,), noise_scale=True)
    names = {}
    for run_id, run in table.groupby("run_id"):
        folder = tmp_path / "runs" / f"L1-d24-B{run['batch_tokens'].iloc[0]}"
        folder.mkdir(parents=True)
        names[folder.name] = run
        (folder / "config.json").write_text(json.dumps({"train": {"batch_tokens": int(run["batch_tokens"].iloc[0]),
                                                                   "lr": 0.01, "seed": 3}}))
        status = "interrupted" if folder.name.endswith("B8192") else "completed"
        (folder / "summary.json").write_text(json.dumps({"params": 20000, "status": status}))
        lines = [json.dumps({"step": int(s), "tokens": 1, "eval_loss": float(v)}) for s, v in
                 zip(run["step"], run["eval_loss"])]
        lines += [json.dumps({"step": int(s), "loss": 3.0, "noise_scale": float(v)}) for s, v in
                  zip(run["step"], run["noise_scale"])]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 5, \"eval_lo")  # a torn last line
    manifest = {"targets": [2.0, 1.9], "held_out_targets": [], "runs": {n: "grid" for n in names} | {"gone": "grid"}}
    (tmp_path / "critical_batch.json").write_text(json.dumps(manifest))
    read, targets, notes = load_points(tmp_path)
    assert targets == {cb.GRID: [2.0, 1.9], cb.HELD_OUT: []}
    assert notes == ["left out 2 run(s) of the design that have not completed: L1-d24-B8192, gone"]
    assert set(read["run_id"]) == set(names) - {"L1-d24-B8192"} and set(read["seed"]) == {3}
    one = read[read["run_id"] == "L1-d24-B256"].sort_values("step")
    expected = names["L1-d24-B256"].sort_values("step")
    for key in ("eval_loss", "noise_scale"):
        assert np.allclose(one[key], expected[key])
