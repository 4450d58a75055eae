"""A real sweep with a [search] on the tiny corpus: the grids run first, their laws set the sweep's runs,
and search runs stay out of the sweep's table; verify's refusals on it."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.cli import EXIT_UNIDENTIFIED
from analysis.synthetic import law_optimum
from analysis.table import load_runs
from lab.runtime.config import DataConfig
from sweeps.spec import PowerRule


pytestmark = pytest.mark.slow  # 15 tiny runs


REPO = Path(__file__).resolve().parents[2]


def sweep_text(data: DataConfig) -> str:
    corpus = (f"{{ corpus = {json.dumps(str(data.corpus))}, cache_dir = {json.dumps(str(data.cache_dir))}, "
              f"vocab_size = {data.vocab_size} }}")
    return f"""
[sweep]
name = "searched"
budgets = [1.5e9, 3e9, 6e9]
sizes = [1.2e4, 2.4e4, 4.8e4]
[search]
budget = 1.5e9
sizes = [1.2e4, 2.4e4]
lr = [3e-3, 1e-2, 3e-2]
batch_tokens = [128, 256, 512]
[shapes]
aspect = 64
width_multiple = 16
head_dim = 16
max_layers = 1
[rules]
lr = 1e-3
batch_tokens = 128
[base]
model = {{ block_size = 32 }}
data = {corpus}
train = {{ micro_batch = 4, eval_tokens = 512, log_every = 1, checkpoint_every = 0 }}
[local]
parallel = 2
threads = 1
"""


@pytest.fixture(scope="module")
def searched(tmp_path_factory, tiny_corpus, tiny_cache_dir, tiny_prepared):
    root = tmp_path_factory.mktemp("searched")
    data = DataConfig(corpus=str(tiny_corpus), cache_dir=str(tiny_cache_dir), vocab_size=512)
    file = root / "searched.toml"
    file.write_text(sweep_text(data))
    folder = root / "sweep"
    proc = subprocess.run([sys.executable, "-m", "sweeps", "run", str(file), "--folder", str(folder), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return file, folder, proc.stdout


def rows(folder) -> dict[str, dict]:
    conn = sqlite3.connect(folder / "sweep.db")
    try:
        return {name: json.loads(plan) for name, plan in conn.execute("SELECT name, plan FROM runs")}
    finally:
        conn.close()


@pytest.mark.long
def test_the_search_runs_first_and_its_laws_set_the_sweeps_runs(searched):
    _, folder, out = searched
    laws = json.loads((folder / "search" / "laws.json").read_text())
    assert (folder / "search" / "search.png").stat().st_size > 10_000
    assert [len(g["values"]) for g in laws["lr"]["grids"]] == [3, 3] and len(laws["batch_tokens"]["grids"]) == 1
    for grid in laws["lr"]["grids"] + laws["batch_tokens"]["grids"]:  # every loss is a run's final eval loss
        assert all(1 < loss < 7 for loss in grid["losses"])
        assert min(grid["values"]) <= grid["best"] <= max(grid["values"])
    lr_law = PowerRule(laws["lr"]["value"], laws["lr"]["exponent"], laws["lr"]["reference"])
    batch_law = PowerRule(laws["batch_tokens"]["value"], laws["batch_tokens"]["exponent"],
                          laws["batch_tokens"]["reference"])
    assert f"search: LR(N) = {lr_law.value:.4g}" in out
    plans = rows(folder)
    search = {n: p for n, p in plans.items() if p["role"] == "search"}
    sweep = {n: p for n, p in plans.items() if p["role"] == "sweep"}
    assert len(search) == 2 * 3 + 3 and len(sweep) == 3 * 3
    lr_grid = [p for p in search.values() if p["batch_tokens"] == 128]
    assert len(lr_grid) >= 6 and {p["budget"] for p in lr_grid} == {1.5e9}
    for p in sweep.values():
        assert p["lr"] == pytest.approx(lr_law.at(p["params"]), rel=1e-3)  # not [rules]'s 1e-3
        assert p["batch_tokens"] == 128 * max(1, round(batch_law.at(p["budget"]) / 128))
    for name in search:
        assert (folder / "search" / "runs" / name / "summary.json").is_file()
        assert not (folder / "runs" / name).exists()


@pytest.mark.long
def test_search_runs_stay_out_of_the_export_and_the_analysis(searched, sweeps_cli, tmp_path):
    _, folder, _ = searched
    assert sweeps_cli("export", folder, "--out", tmp_path / "runs.csv").returncode == 0
    import pandas as pd

    table = pd.read_csv(tmp_path / "runs.csv")
    assert len(table) == 9 and set(table["role"]) == {"sweep"}
    assert sweeps_cli("export", folder, "--out", tmp_path / "all.csv", "--with", "search").returncode == 0
    assert len(pd.read_csv(tmp_path / "all.csv")) == 9 + 9
    assert sorted(load_runs(folder).runs["run_id"]) == sorted(f"runs/{n}" for n in table["run_id"])


@pytest.mark.long
def test_running_again_reruns_nothing_and_plan_shows_the_laws(searched, sweeps_cli):
    file, folder, _ = searched
    proc = sweeps_cli("run", file, "--folder", folder, "--no-progress")
    assert proc.returncode == 0 and "done " not in proc.stdout and "search: LR(N)" in proc.stdout
    proc = sweeps_cli("plan", file, "--folder", folder)
    assert proc.returncode == 0 and "search: LR(N)" in proc.stdout and "not run yet" not in proc.stdout
    for name, p in rows(folder).items():
        if p["role"] == "sweep":
            assert f"{p['lr']:.3g}" in next(line for line in proc.stdout.splitlines() if line.startswith(name + " "))


@pytest.mark.long
def test_verify_refuses_a_budget_that_is_not_held_out_and_an_unidentified_fit(searched, sweeps_cli):
    _, folder, _ = searched
    proc = sweeps_cli("verify", folder, "--budget", "2e9", "--no-progress")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --budget 2e+09 is not held out: the sweep runs budgets up to 6e+09")
    proc = sweeps_cli("verify", folder, "--budget", "2.4e10", "--exclude", "no-such-run")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --exclude 'no-such-run': no run has that id")
    proc = sweeps_cli("verify", folder, "--budget", "2.4e10", "--bootstrap", "-1")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --bootstrap must be 0 or more, got -1"
    before = rows(folder)
    # three budgets of three sizes cannot identify a law: verify says so (exit 3) and trains nothing (the widths
    # that judge identification need no more than 100 resamples here)
    proc = sweeps_cli("verify", folder, "--budget", "2.4e10", "--bootstrap", "100", "--no-progress")
    assert proc.returncode == EXIT_UNIDENTIFIED, proc.stdout + proc.stderr
    assert "report.html says why" in proc.stderr and rows(folder) == before
    assert (folder / "verify" / "fit-C2.4e10" / "fit.json").is_file()



@pytest.mark.long
def test_verify_trains_the_predicted_shapes_at_the_held_out_budget(searched, sweeps_cli, tmp_path):
    """verify's whole path on a real sweep: fit, plan the three shapes around N_opt, train them, judge, record.
    The tiny corpus's losses obey no law, so the copy's recorded losses are replaced by a known law's: the fit
    then predicts a known N_opt, and verify must train real runs around it."""
    _, source, _ = searched
    folder = tmp_path / "sweep"
    shutil.copytree(source, folder)
    law = {"E": 1.5, "A": 300.0, "B": 401.0, "alpha": 0.35, "beta": 0.35}  # N_opt(8e9) = 2.4e4
    for summary in (folder / "runs").glob("*/summary.json"):
        doc = json.loads(summary.read_text())
        n, d = doc["params"], doc["tokens"]
        doc["final_eval_loss"] = law["E"] + law["A"] / n ** law["alpha"] + law["B"] / d ** law["beta"]
        summary.write_text(json.dumps(doc))
    proc = sweeps_cli("verify", folder, "--budget", "8e9", "--bootstrap", "100", "--no-progress")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: the real runs do not follow the law
    verdict = json.loads((folder / "verify" / "verify-C8e9.json").read_text())
    n_opt, (lo, hi) = verdict["prediction"]["n_opt"], verdict["prediction"]["n_opt_ci"]
    assert n_opt == pytest.approx(law_optimum(np.array([8e9]), law)[0][0], rel=0.05) and lo <= n_opt <= hi
    plans = {n: p for n, p in rows(folder).items() if p["role"] == "verify"}
    assert sorted(plans) == sorted(r["name"] for r in verdict["runs"]) and len(plans) == 3
    sizes = sorted(r["params"] for r in verdict["runs"])
    assert sizes[0] < n_opt < sizes[2]
    laws = json.loads((folder / "search" / "laws.json").read_text())
    lr_law = PowerRule(laws["lr"]["value"], laws["lr"]["exponent"], laws["lr"]["reference"])
    for run in verdict["runs"]:  # real runs at the held-out budget, with the search's learning-rate law
        summary = json.loads((folder / "verify" / "runs" / run["name"] / "summary.json").read_text())
        assert summary["final_eval_loss"] == pytest.approx(run["loss"])
        assert plans[run["name"]]["budget"] == 8e9
        assert plans[run["name"]]["lr"] == pytest.approx(lr_law.at(run["params"]), rel=1e-3)
        assert run["predicted_loss"] == pytest.approx(
            law["E"] + law["A"] / run["params"] ** law["alpha"] + law["B"] / run["tokens"] ** law["beta"], rel=0.01)
    assert ("verified" if verdict["verified"] else "NOT verified") in proc.stdout.splitlines()
    report = (folder / "verify" / "fit-C8e9" / "report.md").read_text()
    assert "Verification at the held-out budget C = 8e+09" in report
    meta = sqlite3.connect(folder / "sweep.db").execute("SELECT value FROM meta WHERE key = 'verify 8e+09'").fetchone()
    assert meta is not None and json.loads(meta[0])["best"] == verdict["best"]
