"""Figures: legible with many budgets, published laws drawn for reference, unidentified laws marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from analysis.fit import FitConfig, fit_runs
from analysis.plots import FIGURES, make_plots, plot_allocation, plot_contours, plot_frontier, plot_isoflop
from analysis.published import LAWS
from analysis.synthetic import isoflop_runs, law_loss, law_optimum
from analysis.table import load_runs

LAB_RUNS = Path(__file__).parent / "data" / "lab-tiny-sweep"


def _fit(tmp_path, runs, **config):
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    return fit_runs(load_runs(path), FitConfig(progress=False, holdout=False, **config))


def _labels(fig: plt.Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    runs = isoflop_runs(np.geomspace(1e18, 1e22, 40), per_budget=7, spread=6, noise=0.005, seed=0)
    return _fit(tmp_path_factory.mktemp("many"), runs, n_bootstrap=20)


@pytest.mark.slow
def test_forty_budgets_get_a_colour_bar_not_forty_legend_entries(many):
    assert many.budgets.count == 40
    fig = plot_isoflop(many)
    assert len(_labels(fig)) == 3  # marker kinds only
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "compute C (FLOPs)"  # the colour bar
    plt.close(fig)


def test_published_laws_are_drawn_beside_the_fit(many):
    flops = np.geomspace(1e18, 1e23, 5)
    for maker in (plot_frontier, plot_allocation, plot_contours):
        fig = maker(many)
        labels = _labels(fig)
        for law in LAWS:
            assert f"published: {law.name}" in labels
        plt.close(fig)
    fig = plot_frontier(many)
    [line] = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == f"published: {LAWS[1].name}"]
    x, y = line.get_data()
    n_opt, d_opt = law_optimum(x, LAWS[1].as_dict())
    np.testing.assert_allclose(y, law_loss(n_opt, d_opt, LAWS[1].as_dict()), rtol=1e-12)
    assert x.min() < flops.min() * 1.5  # drawn over the data's compute range and beyond
    plt.close(fig)


@pytest.mark.slow
def test_unidentified_laws_are_marked_in_the_figures(tmp_path):
    result = fit_runs(load_runs(LAB_RUNS), FitConfig(n_bootstrap=50, progress=False))
    fig = plot_allocation(result)
    assert "approach 3 (parametric) (not identified)" in _labels(fig)
    plt.close(fig)
    fig = plot_contours(result)
    assert "NOT identified" in fig.axes[0].get_title()
    plt.close(fig)
    fig = plot_isoflop(result)
    assert fig.axes[0].get_title().startswith("No IsoFLOP budgets")
    plt.close(fig)


@pytest.mark.slow
def test_plots_drawn_over_two_processes_are_the_ones_drawn_in_one(many, tmp_path):
    one = make_plots(many, tmp_path, workers=1)
    two = make_plots(many, tmp_path, workers=2)
    assert list(one) == [stem for stem, _ in FIGURES]
    for stem in one:
        assert one[stem][:8] == b"\x89PNG\r\n\x1a\n" and len(one[stem]) > 10_000
        assert two[stem] == one[stem]
        assert (tmp_path / f"{stem}.png").read_bytes() == two[stem]
