"""Figures: legible with many budgets, published laws drawn only where units compare, ticks labelled inside
the data range, unidentified laws marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from analysis.fit import FitConfig, fit_runs
from analysis.plots import (
    FIGURES,
    LogRangeLocator,
    make_plots,
    plot_allocation,
    plot_contours,
    plot_frontier,
    plot_isoflop,
    short_number,
)
from analysis.published import LAWS
from analysis.synthetic import isoflop_runs, law_loss, law_optimum
from analysis.table import load_runs

LAB_RUNS = Path(__file__).parent / "data" / "lab-tiny-sweep"


def _fit(tmp_path, runs, **config):
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    return fit_runs(load_runs(path), FitConfig(progress=False, holdout=False, **config))


def _labels(fig: plt.Figure) -> list[str]:
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    return [t.get_text() for legend in legends for t in legend.get_texts()]


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


def _notes(fig: plt.Figure) -> list[str]:
    return [t.get_text() for t in fig.texts]


@pytest.mark.slow
def test_published_laws_are_listed_not_drawn_for_runs_on_other_data(many):
    assert many.table.dataset is None and many.to_dict()["data"]["dataset"] is None
    for maker in (plot_frontier, plot_allocation, plot_contours):
        fig = maker(many)
        assert not [label for label in _labels(fig) if label.startswith("published")]
        [note] = _notes(fig)
        assert note.startswith("Published laws not drawn, since their losses are on another data set")
        assert all(law.name in note for law in LAWS)
        plt.close(fig)


@pytest.mark.slow
def test_published_laws_are_drawn_for_runs_on_their_data_set(tmp_path):
    runs = isoflop_runs(np.geomspace(1e18, 1e21, 4), per_budget=7, spread=6, noise=0.005, seed=0)
    result = _fit(tmp_path, runs.assign(dataset="MassiveText"), n_bootstrap=0)
    assert result.table.dataset == "MassiveText"
    for maker in (plot_frontier, plot_allocation, plot_contours):
        fig = maker(result)
        labels = _labels(fig)
        for law in LAWS:
            assert (f"published: {law.name}" in labels) == (law.dataset == "MassiveText")
        [note] = _notes(fig)  # Muennighoff et al.'s law is on C4: listed, not drawn
        assert "Data-constrained law (a = 0.5, C4)" in note and "Chinchilla" not in note
        plt.close(fig)
    fig = plot_frontier(result)
    [line] = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == f"published: {LAWS[1].name}"]
    x, y = line.get_data()
    n_opt, d_opt = law_optimum(x, LAWS[1].as_dict())
    np.testing.assert_allclose(y, law_loss(n_opt, d_opt, LAWS[1].as_dict()), rtol=1e-12)
    assert x.min() < 1e18 * 1.5  # drawn over the data's compute range and beyond
    plt.close(fig)


@pytest.mark.parametrize("lo, hi, expected", [
    (1.6, 2.4, [1.6, 1.8, 2.0, 2.2, 2.4]),
    (1.45, 3.0, [1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0]),
    (2.5e11, 2e12, [3e11, 5e11, 1e12, 2e12]),
    (2e4, 1.2e6, [2e4, 5e4, 1e5, 2e5, 5e5, 1e6]),
    (1e17, 1e23, [1e17, 1e18, 1e19, 1e20, 1e21, 1e22, 1e23]),
])
def test_log_axes_get_labelled_ticks_inside_any_range(lo, hi, expected):
    ticks = LogRangeLocator().tick_values(lo, hi)
    inside = ticks[(ticks >= lo * (1 - 1e-9)) & (ticks <= hi * (1 + 1e-9))]
    assert all(np.any(np.isclose(inside, v, rtol=1e-9)) for v in expected), inside
    assert len(inside) <= 8
    assert [short_number(v) for v in (1.6, 2.0, 500.0, 2.5e4, 1e21)] == ["1.6", "2", "500", "2.5e4", "1e21"]


@pytest.mark.slow
def test_a_narrow_loss_axis_shows_several_labelled_ticks(tmp_path):
    # Lab-sized runs: losses between about 2.2 and 2.9 nats, less than a decade on the frontier's log axis.
    law = {"E": 1.3, "A": 60.0, "B": 300.0, "alpha": 0.45, "beta": 0.42}
    runs = isoflop_runs(np.array([2.5e11, 5e11, 1e12, 2e12]), per_budget=7, spread=4, noise=0.005, law=law)
    fig = plot_frontier(_fit(tmp_path, runs, n_bootstrap=0))
    ax = fig.axes[0]
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    labelled = [(t.get_loc(), t.label1.get_text()) for t in ax.yaxis.get_major_ticks()
                if lo <= t.get_loc() <= hi and t.label1.get_text()]
    data = [v for v, _ in labelled if runs["loss"].min() <= v <= runs["loss"].max()]
    assert len(labelled) >= 5 and len(data) >= 3, labelled
    plt.close(fig)


@pytest.mark.long
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


@pytest.mark.long
@pytest.mark.slow
def test_plots_drawn_over_two_processes_are_the_ones_drawn_in_one(many, tmp_path):
    one = make_plots(many, tmp_path, workers=1)
    two = make_plots(many, tmp_path, workers=2)
    assert list(one) == [stem for stem, _ in FIGURES]
    for stem in one:
        assert one[stem][:8] == b"\x89PNG\r\n\x1a\n" and len(one[stem]) > 10_000
        assert two[stem] == one[stem]
        assert (tmp_path / f"{stem}.png").read_bytes() == two[stem]
