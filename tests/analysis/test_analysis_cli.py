"""End to end: `python -m analysis fit` on a sweep folder, its outputs, and the report in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from analysis.plots import FIGURES
from analysis.synthetic import isoflop_runs, write_sweep

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fit_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    runs = isoflop_runs(np.geomspace(1e18, 1e20, 4), per_budget=6, spread=6, noise=0.01)
    write_sweep(runs, root / "sweep")
    out = root / "out"
    proc = subprocess.run([sys.executable, "-m", "analysis", "fit", str(root / "sweep"), "--out", str(out),
                           "--bootstrap", "50", "--predict", "1e21", "1e23", "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("wrote ") and "fit.json" in proc.stdout.splitlines()[-1]
    return out


def test_fit_json_has_the_documented_keys(fit_out):
    doc = json.loads((fit_out / "fit.json").read_text())
    assert {"E", "A", "B", "alpha", "beta", "a", "b", "ci"} <= set(doc["approach3"])
    assert {"a", "b", "k_N", "k_D", "minima"} <= set(doc["isoflop"])
    assert len(doc["isoflop"]["minima"]) == 4
    assert [p["flops"] for p in doc["predictions"]] == [1e21, 1e23]
    for p in doc["predictions"]:
        assert {"flops", "params", "tokens", "loss", "ci"} <= set(p)
        assert p["ci"]["loss"][0] <= p["loss"] <= p["ci"]["loss"][1]
    assert doc["holdout"]["skipped"] is False and doc["holdout"]["approach3"]["mean_rel_error"] >= 0
    assert doc["params_count"] == "total"
    assert doc["envelope"]["skipped"] is False
    assert any(w["code"] == "extrapolation" for w in doc["warnings"])  # 1e23 is 1000x the data
    assert doc["approach3"]["bootstrap"]["resamples"] == 50


def test_every_plot_is_written_as_png_and_svg(fit_out):
    for stem, _ in FIGURES:
        png, svg = fit_out / f"{stem}.png", fit_out / f"{stem}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        assert "<svg" in svg.read_text()[:2000], stem
    assert not [p for p in fit_out.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_reports_cover_data_fits_holdout_predictions_plots_and_warnings(fit_out):
    md = (fit_out / "report.md").read_text()
    html = (fit_out / "report.html").read_text()
    sections = ["## Data", "## Fits", "## Hold-out check", "## Predictions", "## Plots", "## Warnings"]
    assert [md.index(s) for s in sections] == sorted(md.index(s) for s in sections)
    hold = json.loads((fit_out / "fit.json").read_text())["holdout"]["approach3"]
    assert f"mean rel {hold['mean_rel_error']:.2%}" in md
    for stem, _ in FIGURES:
        assert f"({stem}.png)" in md and f'src="{stem}.png"' in html
    assert "extrapolate more than 100x" in md and "extrapolate more than 100x" in html


def test_plan_reads_the_fit_and_its_bootstrap(fit_out):
    proc = subprocess.run([sys.executable, "-m", "analysis", "plan", str(fit_out / "fit.json"), "--gpu", "H100",
                           "--n-gpus", "64", "--mfu", "0.4", "--flops", "1e21", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    first = json.loads((fit_out / "fit.json").read_text())["predictions"][0]
    assert result["params"] == pytest.approx(first["params"], rel=1e-9)
    assert result["ci"]["params"] == pytest.approx(first["ci"]["params"], rel=1e-9)


def _artifacts_dir() -> Path:
    return Path(os.environ.get("SCALING_LAB_ARTIFACTS") or REPO / "build" / "test-artifacts")


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
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get((fit_out / "report.html").as_uri())
        deadline = time.monotonic() + 30
        while not driver.execute_script("return Array.from(document.images).every(i => i.complete)"):
            assert time.monotonic() < deadline, "images did not finish loading"
            time.sleep(0.1)
        widths = driver.execute_script("return Array.from(document.images).map(i => i.naturalWidth)")
        assert len(widths) == len(FIGURES) and all(w > 0 for w in widths), widths
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
