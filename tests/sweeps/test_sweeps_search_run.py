"""A real sweep with a [search] on the tiny corpus: the grids run first, their laws set the sweep's runs,
and search runs stay out of the sweep's table; verify's refusals on it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.__main__ import EXIT_UNIDENTIFIED
from analysis.table import load_runs
from lab.config import DataConfig
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
sizes = [1.2e4, 2.4e4]
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
train = {{ micro_batch = 4, eval_tokens = 512, log_every = 1 }}
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
    assert len(search) == 2 * 3 + 3 and len(sweep) == 3 * 2
    lr_grid = [p for p in search.values() if p["batch_tokens"] == 128]
    assert len(lr_grid) >= 6 and {p["budget"] for p in lr_grid} == {1.5e9}
    for p in sweep.values():
        assert p["lr"] == pytest.approx(lr_law.at(p["params"]), rel=1e-3)  # not [rules]'s 1e-3
        assert p["batch_tokens"] == 128 * max(1, round(batch_law.at(p["budget"]) / 128))
    for name in search:
        assert (folder / "search" / "runs" / name / "summary.json").is_file()
        assert not (folder / "runs" / name).exists()


def test_search_runs_stay_out_of_the_export_and_the_analysis(searched, sweeps_cli, tmp_path):
    _, folder, _ = searched
    assert sweeps_cli("export", folder, "--out", tmp_path / "runs.csv").returncode == 0
    import pandas as pd

    table = pd.read_csv(tmp_path / "runs.csv")
    assert len(table) == 6 and set(table["role"]) == {"sweep"}
    assert sweeps_cli("export", folder, "--out", tmp_path / "all.csv", "--with", "search").returncode == 0
    assert len(pd.read_csv(tmp_path / "all.csv")) == 6 + 9
    assert sorted(load_runs(folder).runs["run_id"]) == sorted(f"runs/{n}" for n in table["run_id"])


def test_running_again_reruns_nothing_and_plan_shows_the_laws(searched, sweeps_cli):
    file, folder, _ = searched
    proc = sweeps_cli("run", file, "--folder", folder, "--no-progress")
    assert proc.returncode == 0 and "done " not in proc.stdout and "search: LR(N)" in proc.stdout
    proc = sweeps_cli("plan", file, "--folder", folder)
    assert proc.returncode == 0 and "search: LR(N)" in proc.stdout and "not run yet" not in proc.stdout
    for name, p in rows(folder).items():
        if p["role"] == "sweep":
            assert f"{p['lr']:.3g}" in next(line for line in proc.stdout.splitlines() if line.startswith(name + " "))


def test_verify_refuses_a_budget_that_is_not_held_out_and_an_unidentified_fit(searched, sweeps_cli):
    _, folder, _ = searched
    proc = sweeps_cli("verify", folder, "--budget", "2e9", "--no-progress")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --budget 2e+09 is not held out: the sweep runs budgets up to 6e+09")
    proc = sweeps_cli("verify", folder, "--budget", "2.4e10", "--exclude", "no-such-run")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --exclude 'no-such-run': no run has that id")
    before = rows(folder)
    # three budgets of two sizes cannot identify a law: verify says so (exit 3) and trains nothing
    proc = sweeps_cli("verify", folder, "--budget", "2.4e10", "--no-progress")
    assert proc.returncode == EXIT_UNIDENTIFIED, proc.stdout + proc.stderr
    assert "report.html says why" in proc.stderr and rows(folder) == before
    assert (folder / "verify" / "fit-C2.4e10" / "fit.json").is_file()
