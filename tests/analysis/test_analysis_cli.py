"""End to end: `python -m analysis fit` on a sweep folder, its outputs, and the report in Chromium."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from analysis.plots import CURVES_FIGURE, FIGURES
from analysis.synthetic import isoflop_runs, write_sweep

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fit_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    runs = isoflop_runs(np.geomspace(1e18, 1e20, 4), per_budget=6, spread=6, noise=0.01)
    write_sweep(runs, root / "sweep")
    out = root / "out"
    proc = subprocess.run([sys.executable, "-m", "analysis", "fit", str(root / "sweep"), "--out", str(out),
                           "--bootstrap", "50", "--predict", "1e21", "1e23", "--workers", "1", "--form", "chinchilla"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("wrote ") and "fit.json" in proc.stdout.splitlines()[-1]
    return out


@pytest.mark.slow
def test_fit_json_has_the_documented_keys(fit_out):
    doc = json.loads((fit_out / "fit.json").read_text())
    assert doc["schema_version"] == 2 and doc["loss"]["unit"] == "nats per token"
    assert {"E", "A", "B", "alpha", "beta", "a", "b", "ci", "goodness", "covariance",
            "identification"} <= set(doc["approach3"])
    assert {"a", "b", "k_N", "k_D", "minima", "identification"} <= set(doc["isoflop"])
    assert len(doc["isoflop"]["minima"]) == 4
    assert [p["flops"] for p in doc["predictions"]] == [1e21, 1e23]
    for p in doc["predictions"]:
        a3 = p["approach3"]
        assert {"params", "tokens", "loss", "ci", "identified"} <= set(a3)
        assert a3["ci"]["loss"][0] <= a3["loss"] <= a3["ci"]["loss"][1]
        assert {"params", "tokens", "ci"} <= set(p["isoflop"]) and {"params", "tokens", "ci"} <= set(p["envelope"])
    assert doc["holdout"]["skipped"] is False and doc["holdout"]["approach3"]["mean_rel_error"] >= 0
    assert doc["params_count"] == "total"
    assert doc["envelope"]["skipped"] is False
    assert doc["comparison"]["preferred"] == "approach3"
    assert doc["approach3"]["identification"]["identified"] is True
    for key in ("isoflop", "envelope"):  # 4 budgets at 1% noise: identified or not, each check says why
        ident = doc[key]["identification"]
        assert ident["identified"] == all(c["passed"] for c in ident["checks"])
        assert len(ident["checks"]) == (4 if key == "envelope" else 3)  # approach 1 on budgets: the edge check too
    assert any(w["code"] == "extrapolation" for w in doc["warnings"])  # 1e23 is 1000x the data
    assert doc["approach3"]["bootstrap"]["resamples"] == 50
    cov = doc["approach3"]["covariance"]
    assert cov["names"] == ["log A", "log B", "log E", "alpha", "beta"]
    assert np.allclose(np.diag(cov["correlation"]), 1.0) and np.all(np.array(cov["std"]) > 0)
    good = doc["approach3"]["goodness"]
    assert 0 < good["rmse_loss"] < 0.1 and good["huber_objective"] == doc["approach3"]["fit"]["objective"]


@pytest.mark.slow
def test_every_plot_is_written_as_png(fit_out):
    for stem, _ in FIGURES:
        assert (fit_out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
    assert not [p for p in fit_out.iterdir() if p.name.startswith(".")]  # no staging left behind


@pytest.mark.slow
def test_reports_cover_what_a_reader_of_the_chinchilla_paper_looks_for(fit_out):
    md = (fit_out / "report.md").read_text()
    html = (fit_out / "report.html").read_text()
    doc = json.loads((fit_out / "fit.json").read_text())
    sections = ["## What was fitted", "## Results", "## Identification", "## Approach 3: parameters",
                "## Approaches compared", "## Data", "## Hold-out check", "## Figures", "## Warnings",
                "## Method", "## References"]
    assert [md.index(s) for s in sections] == sorted(md.index(s) for s in sections)
    assert "Law used for planning: approach 3 (parametric)" in md
    assert "nats per token" in md and "L(N, D) = E + A/N^alpha + B/D^beta" in md
    # Table 3: a and b with intervals per approach, N_opt and D_opt at the budgets, published rows.
    a3 = doc["approach3"]
    assert f"| approach 3 (parametric) | yes | {a3['a']:.3g} [{a3['ci']['a'][0]:.3g}, {a3['ci']['a'][1]:.3g}]" in md
    assert "N_opt at C = 1e+21 | D_opt at C = 1e+21" in md
    for row in ("Chinchilla approach 2 (IsoFLOP profiles) |  | 0.49 [0.462, 0.534]",
                "published law: Epoch AI replication of approach 3 |  | 0.513 | 0.487 | - | - |",
                "Kaplan et al. (2020)"):
        assert row in md
    # these runs name no data set, so the published laws' N_opt and D_opt are left out and listed in a note
    assert "Published laws not drawn, since their losses are on another data set with its tokenizer" in md
    assert "Chinchilla approach 3 (a = 0.452, MassiveText)" in md
    assert "arXiv:2203.15556" in md and "arXiv:2404.10102" in md
    # Goodness of fit and covariance.
    assert f"RMSE {a3['goodness']['rmse_loss']:.4g} nats per token" in md
    assert "|  | std | log A | log B | log E | alpha | beta |" in md
    # Predictions side by side, IsoFLOP D_opt included.
    iso = doc["predictions"][0]["isoflop"]
    state = "yes" if iso["identified"] else "NO"
    assert f"| 1e+21 | 10x | approach 2 (IsoFLOP) | {state} | {iso['params']:.4g} [" in md
    assert f"{iso['tokens']:.4g} [" in md
    hold = doc["holdout"]["approach3"]
    assert f"mean rel {hold['mean_rel_error']:.2%}" in md
    for stem, _ in FIGURES + (CURVES_FIGURE,):  # a sweep folder: its training curves are drawn too
        assert f"({stem}.png)" in md
    assert "extrapolate more than 100x" in md and "extrapolate more than 100x" in html


def test_html_report_is_one_self_contained_file(fit_out):
    html = (fit_out / "report.html").read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert sources and all(s.startswith("data:") for s in sources), sources
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == len(FIGURES) + 1
    for stem, data in zip((stem for stem, _ in FIGURES + (CURVES_FIGURE,)), images):
        assert base64.b64decode(data) == (fit_out / f"{stem}.png").read_bytes()


@pytest.mark.slow
def test_plan_reads_the_fit_and_its_bootstrap(fit_out):
    proc = subprocess.run([sys.executable, "-m", "analysis", "plan", str(fit_out / "fit.json"), "--gpu", "H100",
                           "--n-gpus", "64", "--mfu", "0.4", "--flops", "1e21", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    first = json.loads((fit_out / "fit.json").read_text())["predictions"][0]
    assert result["approach"] == "approach3"
    for key in ("approach3", "isoflop", "envelope"):
        assert result["approaches"][key]["params"] == pytest.approx(first[key]["params"], rel=1e-9)
        assert result["approaches"][key]["ci"]["params"] == pytest.approx(first[key]["ci"]["params"], rel=1e-9)
    assert result["params"] == pytest.approx(first["approach3"]["params"], rel=1e-9)
    assert result["loss"] == pytest.approx(first["approach3"]["loss"], rel=1e-9)


def _artifacts_dir() -> Path:
    return Path(os.environ.get("SCALING_LAB_ARTIFACTS") or REPO / "build" / "test-artifacts")


@pytest.mark.slow
def test_report_opens_in_headless_chromium(fit_out, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if not (chromium and driver_path and webdriver):
        message = "headless Chromium test needs selenium, chromium and chromedriver"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI installs them)")
        pytest.skip(message)

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    alone = tmp_path / "alone"  # the HTML on its own, away from the PNG files
    alone.mkdir()
    shutil.copy(fit_out / "report.html", alone)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get((alone / "report.html").as_uri())
        deadline = time.monotonic() + 30
        while not driver.execute_script("return Array.from(document.images).every(i => i.complete)"):
            assert time.monotonic() < deadline, "images did not finish loading"
            time.sleep(0.1)
        widths = driver.execute_script("return Array.from(document.images).map(i => i.naturalWidth)")
        assert len(widths) == len(FIGURES) + 1 and all(w > 0 for w in widths), widths
        assert "Hold-out check" in driver.find_element("tag name", "body").text
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(int(height) + 100, 12000))
        artifacts = _artifacts_dir()
        artifacts.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(artifacts / "report.png"))
    finally:
        driver.quit()
    assert (artifacts / "report.png").stat().st_size > 10_000
