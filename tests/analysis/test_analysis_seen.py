"""One test per "Seen" line of issue 12, each through the command line and fit.json.

Every test here failed on the analysis package as it was before the issue (checked by running
this file against that tree) and passes now.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import analysis.outputs as outputs
from analysis.cli import main
from analysis.synthetic import continuous_runs, isoflop_runs, law_optimum, write_sweep

REPO = Path(__file__).resolve().parents[2]
LAB_RUNS = Path(__file__).parent / "data" / "lab-tiny-sweep"
BUDGETS = np.geomspace(1e18, 1e21, 7)
EPOCH = {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}
PLAN = ["--gpu", "H100", "--n-gpus", "8", "--mfu", "0.4"]


def _fit(capsys, source: Path, out: Path, *extra: str) -> tuple[int, dict | None, str, str]:
    """Exit code, fit.json (if written), stdout and stderr of `python -m analysis fit`."""
    capsys.readouterr()
    rc = main(["fit", str(source), "--out", str(out), "--no-progress", "--workers", "1", *extra])
    captured = capsys.readouterr()
    doc = json.loads((out / "fit.json").read_text()) if (out / "fit.json").exists() else None
    return rc, doc, captured.out, captured.err


def _csv(tmp_path: Path, runs: pd.DataFrame, name: str = "runs.csv") -> Path:
    path = tmp_path / name
    runs.to_csv(path, index=False)
    return path


@pytest.mark.long
@pytest.mark.slow
def test_the_labs_own_tiny_runs_give_no_law_and_no_plan(tmp_path, capsys):
    # Six real runs of the lab (tests/test_end_to_end.py's sweep, kept in tests/analysis/data):
    # 3 sizes x 2 token counts at a few thousand tokens. Before: alpha ~ 59 or ~ 0.005, exit 0, and
    # plan used the law.
    rc, doc, out, err = _fit(capsys, LAB_RUNS, tmp_path / "out", "--bootstrap", "100")
    assert rc == 3
    assert err.strip().startswith("error: no approach is identified") and len(err.strip().splitlines()) == 1
    ident = doc["approach3"]["identification"]
    assert ident["identified"] is False
    assert any("condition number" in r for r in ident["reasons"])
    assert any("2 distinct D" in r for r in ident["reasons"])
    assert doc["comparison"]["preferred"] is None
    assert "No approach gives an identified law" in (tmp_path / "out" / "report.md").read_text()
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "out" / "fit.json"), *PLAN, "--flops", "1e21"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: refusing to plan")


@pytest.mark.long
@pytest.mark.slow
def test_a_single_compute_budget_is_refused_for_approaches_1_and_2(tmp_path, capsys):
    runs = isoflop_runs(np.array([1e20]), per_budget=12, spread=8, noise=0.005, seed=0)
    write_sweep(runs, tmp_path / "sweep")  # with training curves, so approach 1 has data to misuse
    rc, doc, _, err = _fit(capsys, tmp_path / "sweep", tmp_path / "out", "--bootstrap", "100")
    assert rc == 3 and err.startswith("error: ")
    for key in ("isoflop", "envelope"):
        assert doc[key]["skipped"] is True and "one compute budget" in doc[key]["reason"]
    ident = doc["approach3"]["identification"]
    assert ident["identified"] is False and any("one compute budget" in r for r in ident["reasons"])


@pytest.mark.slow
def test_lopsided_isoflop_profiles_give_the_optimum_and_flag_one_sided_ones(tmp_path, capsys):
    # Sizes from 0.5x to 50x each budget's optimum (many more above it), on the Epoch AI law whose
    # alpha and beta are nearly equal; before, the parabola vertex was 0.058 decades off in every budget.
    runs = isoflop_runs(BUDGETS[:6], per_budget=12, spread=10, offset=5.0, noise=0.0, law=EPOCH)
    one_sided = isoflop_runs(BUDGETS[6:], per_budget=9, spread=10, offset=6.0, noise=0.0, law=EPOCH)
    runs = pd.concat([runs, one_sided.assign(run_id=one_sided["run_id"] + "x")], ignore_index=True)
    rc, doc, _, _ = _fit(capsys, _csv(tmp_path, runs), tmp_path / "out", "--bootstrap", "0",
                         "--isoflop-minimum", "vertex")  # the windowed vertex and its flags
    assert rc == 0
    truth = np.log10(law_optimum(BUDGETS, EPOCH)[0])
    minima = doc["isoflop"]["minima"]
    errors = [abs(np.log10(m["vertex"]["params"]) - t) for m, t in zip(minima[:6], truth)]
    assert max(errors) < 0.01, errors
    assert minima[6]["status"].startswith("one-sided") and minima[6]["sizes_below"] == 1
    assert any(w["code"] == "isoflop_one_sided" and f"{BUDGETS[6]:.3g}" in w["message"] for w in doc["warnings"])


@pytest.mark.long
@pytest.mark.slow
def test_duplicate_rows_are_reported_and_do_not_narrow_the_intervals(tmp_path, capsys):
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    twice = pd.concat([runs, runs.assign(run_id=runs["run_id"] + "-again")], ignore_index=True)
    _, once_doc, _, _ = _fit(capsys, _csv(tmp_path, runs), tmp_path / "once", "--bootstrap", "100", "--seed", "1")
    rc, doc, _, _ = _fit(capsys, _csv(tmp_path, twice, "twice.csv"), tmp_path / "twice", "--bootstrap", "100",
                         "--seed", "1", "--duplicates", "mean")
    assert rc == 0
    assert any(w["code"] == "duplicates" and "126 runs share N and D" in w["message"] for w in doc["warnings"])
    assert len(doc["data"]["duplicates"]) == 63
    assert doc["approach3"]["ci"]["alpha"] == once_doc["approach3"]["ci"]["alpha"]
    assert doc["approach3"]["ci"]["a"] == once_doc["approach3"]["ci"]["a"]
    rc, _, _, err = _fit(capsys, _csv(tmp_path, twice, "twice.csv"), tmp_path / "refused", "--duplicates", "refuse")
    assert rc == 2 and err.startswith("error: duplicate runs: 126 runs share N and D")


@pytest.mark.slow
def test_flops_far_from_k_n_d_are_flagged(tmp_path, capsys):
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    runs.loc[[5, 40], "flops"] *= 10.0
    rc, doc, _, _ = _fit(capsys, _csv(tmp_path, runs), tmp_path / "out", "--bootstrap", "0")
    assert rc == 0
    [warning] = [w for w in doc["warnings"] if w["code"] == "flops_mismatch"]
    assert "run0005 (10x)" in warning["message"] and "run0040 (10x)" in warning["message"]
    k = doc["data"]["flops_per_param_token"]
    assert k["k"] == pytest.approx(6.0, rel=1e-9)
    assert [o["run_id"] for o in k["outliers"]] == ["run0005", "run0040"]


@pytest.mark.slow
def test_a_ladder_of_budgets_1_percent_apart_stays_four_budgets(tmp_path, capsys):
    runs = pd.concat([isoflop_runs(np.array([1e19 * 1.01 ** i]), per_budget=7, spread=6, noise=0.0)
                      .assign(run_id=lambda r, i=i: r["run_id"] + f"-{i}") for i in range(4)], ignore_index=True)
    rc, doc, _, _ = _fit(capsys, _csv(tmp_path, runs), tmp_path / "out", "--bootstrap", "0")
    assert len(doc["isoflop"]["minima"]) == 4
    assert [m["n_runs"] for m in doc["isoflop"]["minima"]] == [7, 7, 7, 7]


@pytest.mark.slow
def test_continuous_budgets_make_no_fake_groups_and_a_legible_plot(tmp_path, capsys):
    from analysis.fit import FitConfig, fit_runs
    from analysis.plots import plot_isoflop
    from analysis.table import load_runs

    path = _csv(tmp_path, continuous_runs(245, seed=0))
    rc, doc, _, _ = _fit(capsys, path, tmp_path / "out", "--bootstrap", "0")
    assert doc["isoflop"]["minima"] == [] and doc["isoflop"]["skipped"] is True
    assert "continuous" in doc["isoflop"]["reason"]
    assert doc["envelope"]["skipped"] is False  # approach 1 on the final losses instead
    fig = plot_isoflop(fit_runs(load_runs(path), FitConfig(n_bootstrap=0, progress=False, holdout=False)))
    legend = fig.axes[0].get_legend()
    assert legend is None or len(legend.get_texts()) <= 4


@pytest.mark.slow
def test_the_start_grid_warning_is_quiet_on_clean_data(tmp_path, capsys):
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    rc, doc, _, _ = _fit(capsys, _csv(tmp_path, runs), tmp_path / "out", "--bootstrap", "0")
    assert rc == 0
    assert not [w for w in doc["warnings"] if "grid" in w["code"]], doc["warnings"]


@pytest.mark.slow
def test_plan_shows_every_approach_and_warns_when_they_disagree(tmp_path, capsys):
    # Continuous budgets as in tables read off published plots: approach 1 (frontier of final
    # losses) and approach 3 differ by about 2x in N_opt at 100x the data, beyond their intervals.
    path = _csv(tmp_path, continuous_runs(245, seed=0))
    rc, doc, out, _ = _fit(capsys, path, tmp_path / "out", "--bootstrap", "200")
    assert rc == 0
    assert "approach 1 (envelope): a=" in out and "from final losses (end points only)" in out
    [used] = [line for line in out.splitlines() if line.startswith("plan uses ")]
    assert "WARNING: it DISAGREES with approach 1 (envelope)" in used
    flops = 100 * doc["data"]["flops"][1]
    assert any(w["code"] == "approaches_disagree" for w in doc["warnings"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- **!** Approaches disagree: at C = " in report and "Identified approaches DISAGREE" in report
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "out" / "fit.json"), *PLAN, "--flops", f"{flops:.6g}"]) == 0
    text = capsys.readouterr().out
    assert "law         approach 3 (parametric): it is identified" in text
    assert "approach 1 (envelope)" in text and "APPROACHES DISAGREE" in text and "it DISAGREES with" in text
    assert main(["plan", str(tmp_path / "out" / "fit.json"), *PLAN, "--flops", f"{flops:.6g}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    [x] = result["disagreements"]
    assert set(x["approaches"]) == {"envelope", "approach3"} and x["ratio"] > 1.5 and x["ci"][0] > 1.0


@pytest.mark.slow
def test_a_signal_while_the_outputs_are_renamed_into_place_publishes_all_of_them(tmp_path, monkeypatch, capsys):
    """The renames are all or nothing: SIGTERM arriving during them is handled after the last one."""
    path = _csv(tmp_path, isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0))
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.json").write_text("earlier fit")
    swap = outputs.swap_folders

    def swap_after_a_signal(new, target):
        os.kill(os.getpid(), signal.SIGTERM)
        return swap(new, target)

    monkeypatch.setattr(outputs, "swap_folders", swap_after_a_signal)
    assert main(["fit", str(path), "--out", str(out), "--bootstrap", "0", "--no-progress"]) == 130
    assert json.loads((out / "fit.json").read_text())["data"]["n_runs"] > 0  # the new fit, whole
    assert (out / "report.html").exists() and not list(tmp_path.glob(".out.fit-staging-*"))
    assert capsys.readouterr().err.strip().endswith(f"error: interrupted after writing the outputs to {out}")


@pytest.mark.slow
def test_a_fit_replaces_its_outputs_as_a_whole(tmp_path, capsys):
    """Issue 32: a folder swap, so an earlier fit's files (a figure format not asked for now) never mix with the
    new fit's, and the swap is one step (the earlier folder is whole until it)."""
    path = _csv(tmp_path, isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0))
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.json").write_text("earlier fit")
    (out / "isoflop.pdf").write_text("an earlier fit's figure")
    assert main(["fit", str(path), "--out", str(out), "--bootstrap", "0", "--no-progress"]) == 0
    assert json.loads((out / "fit.json").read_text())["data"]["n_runs"] > 0
    assert not (out / "isoflop.pdf").exists() and (out / "report.html").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    new, old = tmp_path / "new", tmp_path / "old"
    for folder, text in ((new, "new"), (old, "old")):
        folder.mkdir()
        (folder / "fit.json").write_text(text)
    outputs.swap_folders(new, old)
    assert (old / "fit.json").read_text() == "new" and (new / "fit.json").read_text() == "old"


@pytest.mark.slow
def test_interrupted_fits_leave_no_staging_folders(tmp_path):
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    path = _csv(tmp_path, runs)
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.json").write_text("earlier fit")
    # A staging folder left by a process that no longer exists (as after SIGKILL) is cleaned up...
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.fit-staging-{dead.stdout.strip()}-abc123"
    stale.mkdir()
    (stale / "fit.json").write_text("half")
    # ...and SIGTERM while the outputs are being staged removes this run's own folder.
    proc = subprocess.Popen([sys.executable, "-m", "analysis", "fit", str(path), "--out", str(out), "--bootstrap",
                             "0", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.glob(".out.fit-staging-*") if p != stale]:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert not list(tmp_path.glob(".out.fit-staging-*"))
    assert (out / "fit.json").read_text() == "earlier fit"
    assert proc.returncode == 130 and err.strip() == "error: interrupted; earlier outputs are untouched"
