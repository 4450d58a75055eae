"""Issue 21: repeats kept as points, outliers, exclusions, noiseless data, published laws, Huber delta, hold-out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.cli import main
from analysis.fit import FitConfig, fit_runs
from analysis.parametric import fit_parametric
from analysis.published import LAWS
from analysis.report import build_blocks, render_markdown
from analysis.synthetic import isoflop_runs
from analysis.table import InputError, load_runs

BUDGETS = np.geomspace(1e18, 1e21, 5)
QUICK = FitConfig(n_bootstrap=0, progress=False, holdout=False, delta_sensitivity=False)


def _csv(tmp_path: Path, runs: pd.DataFrame, name: str = "runs.csv") -> Path:
    path = tmp_path / name
    runs.to_csv(path, index=False)
    return path


def _runs(noise: float = 0.005, seed: int = 0) -> pd.DataFrame:
    return isoflop_runs(BUDGETS, per_budget=8, spread=6, noise=noise, seed=seed)


def _with_repeats(runs: pd.DataFrame) -> pd.DataFrame:
    """Every run of the first two budgets again, 3 % higher: runs at one N and D on less unique data."""
    again = runs.iloc[:16].assign(run_id=runs["run_id"].iloc[:16] + "-rep", loss=runs["loss"].iloc[:16] * 1.03)
    return pd.concat([runs, again], ignore_index=True)


@pytest.mark.slow
def test_repeats_are_each_their_own_point_by_default_and_warned_with_their_spread(tmp_path):
    path = _csv(tmp_path, _with_repeats(_runs()))
    kept = load_runs(path)
    assert len(kept.runs) == 56 and kept.duplicate_policy == "keep" and len(kept.duplicates) == 16
    [(code, message)] = [w for w in kept.warnings if w[0] == "duplicates"]
    assert "32 runs share N and D" in message and "kept as its own point" in message
    largest = max(g["loss_range"] for g in kept.duplicates)
    assert f"largest {largest:.3g} nats" in message and largest == pytest.approx(0.03 * kept.loss.max(), rel=0.5)
    averaged = load_runs(path, duplicates="mean")
    assert len(averaged.runs) == 40 and averaged.runs["run_id"].str.contains(r"\+1 repeat").sum() == 16
    assert len(load_runs(path, duplicates="aggregate").runs) == 40  # the old name still works
    with pytest.raises(InputError, match="duplicate runs: 32 runs share N and D"):
        load_runs(path, duplicates="refuse")
    # every row weighs in the fit: the kept fit differs from the averaged one, and equals a fit of the raw rows
    theta_kept = fit_runs(kept, QUICK).parametric.theta
    raw = fit_parametric(kept.n, kept.d, kept.loss).theta
    np.testing.assert_allclose(theta_kept, raw, rtol=1e-8)
    assert not np.allclose(theta_kept, fit_runs(averaged, QUICK).parametric.theta, rtol=1e-3)


@pytest.mark.slow
def test_an_outlier_is_flagged_in_the_terminal_and_the_report_and_dropped_on_request(tmp_path, capsys):
    runs = _runs()
    runs.loc[10, "loss"] += 1.0  # one run 1 nat above the law, as a point misread off a figure
    path = _csv(tmp_path, runs)
    cut = f"loss > {runs['loss'].drop(10).max() + 0.01:.3f}"
    out = tmp_path / "fit"
    assert main(["fit", str(path), "--out", str(out), "--bootstrap", "0", "--no-progress", "--no-holdout"]) == 0
    terminal = capsys.readouterr().out
    assert "warning [outliers]: 1 run(s) lie more than 3.5 robust standard deviations" in terminal
    assert "run0010 (+0.9" in terminal or "run0010 (+1" in terminal
    doc = json.loads((out / "fit.json").read_text())
    [flag] = doc["outliers"]["runs"]
    assert flag["run_id"] == "run0010" and flag["z"] > 3.5 and flag["residual"] == pytest.approx(1.0, abs=0.05)
    report = (out / "report.md").read_text()
    assert "## Outliers and dropped runs" in report and "| run0010 |" in report
    assert report.index("- **!** 1 run(s) lie more than 3.5") < report.index("## What was fitted")
    assert "No run was left out" in report

    # the replicators' recipe: drop the K highest losses; and --exclude by id or by condition
    assert main(["fit", str(path), "--out", str(out), "--bootstrap", "0", "--no-progress", "--no-holdout",
                 "--drop-highest-loss", "1"]) == 0
    capsys.readouterr()
    docs = {"--drop-highest-loss 1": json.loads((out / "fit.json").read_text())}
    for item in ("run0010", cut):
        docs[f"--exclude {item}"] = fit_runs(load_runs(path, exclude=[item]), QUICK).to_dict()
    for reason, doc in docs.items():
        assert [d["run_id"] for d in doc["dropped"]] == ["run0010"] and doc["dropped"][0]["reason"] == reason
        assert doc["data"]["n_runs"] == 39 and doc["outliers"]["runs"] == []
        assert f"| run0010 | {doc['dropped'][0]['params']:.4g}" in render_markdown(build_blocks(doc))


@pytest.mark.parametrize("extra,message", [
    (["--exclude", "no such run"], "error: --exclude 'no such run': no run has that id, and it is not a condition"),
    (["--exclude", "params"], "error: --exclude 'params': no run has that id, and it is not a true/false condition"),
    (["--drop-highest-loss", "40"], "error: --drop-highest-loss 40 would drop every one of the 40 runs"),
    (["--huber-delta", "0"], "error: --huber-delta must be a positive number"),
    (["--holdout-budgets", "0"], "error: --holdout-budgets must be >= 1"),
])
def test_bad_selections_are_one_line_errors_before_any_work(tmp_path, capsys, extra, message):
    path = _csv(tmp_path, _runs())
    out = tmp_path / "fit"
    assert main(["fit", str(path), "--out", str(out), "--bootstrap", "0", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_noiseless_data_are_named_and_their_starts_agree():
    table_path_free = isoflop_runs(BUDGETS, per_budget=8, spread=6, noise=0.0, seed=0)
    fit = fit_parametric(table_path_free["params"].to_numpy(), table_path_free["tokens"].to_numpy(),
                         table_path_free["loss"].to_numpy())
    assert fit.objective < 1e-12  # the objective is near zero, where a relative test compares rounding only
    assert fit.starts_agreeing == fit.n_starts


@pytest.mark.slow
def test_noiseless_data_warn_and_no_false_start_alarm(tmp_path):
    path = _csv(tmp_path, isoflop_runs(BUDGETS, per_budget=8, spread=6, noise=0.0, seed=0))
    result = fit_runs(load_runs(path), FitConfig(n_bootstrap=20, progress=False, holdout=False,
                                                 delta_sensitivity=False))
    codes = [c for c, _ in result.warnings]
    assert "noiseless" in codes and "start_grid" not in codes
    assert result.noiseless and result.outliers["runs"] == []
    report = render_markdown(build_blocks(result.to_dict()))
    assert report.index("- **!** NOISELESS DATA") < report.index("## What was fitted")  # in the alert at the top
    noisy = fit_runs(load_runs(_csv(tmp_path, _runs(), "noisy.csv")), QUICK)
    assert not noisy.noiseless and "noiseless" not in [c for c, _ in noisy.warnings]


@pytest.mark.slow
def test_published_rows_give_e_a_b_alpha_beta_of_each_paper(tmp_path):
    by_name = {law.name: law for law in LAWS}
    assert (by_name["Chinchilla approach 3"].E, by_name["Chinchilla approach 3"].A) == (1.69, 406.4)
    assert by_name["Epoch AI replication of approach 3"].B == 2085.43
    muennighoff = by_name["Data-constrained law"]
    assert (muennighoff.alpha, muennighoff.beta, muennighoff.r_d_star, muennighoff.dataset) == (0.353, 0.353, 15.387,
                                                                                                  "C4")
    doc = fit_runs(load_runs(_csv(tmp_path, _runs())), QUICK).to_dict()
    report = render_markdown(build_blocks(doc))
    assert "| published law | data | E | A | B | alpha | beta | R_D* | R_N* | source |" in report
    for law in LAWS:
        assert f"| {law.name} | {law.dataset} | {law.E:.4g} | {law.A:.4g} | {law.B:.4g} | {law.alpha:.4g} |" in report


@pytest.mark.slow
def test_huber_delta_is_used_and_the_report_has_a_delta_sensitivity_table(tmp_path, capsys):
    runs = _runs()
    runs.loc[10, "loss"] += 1.0
    table = load_runs(_csv(tmp_path, runs))
    result = fit_runs(table, FitConfig(n_bootstrap=0, progress=False, holdout=False, huber_delta=1e-2))
    deltas = [r["huber_delta"] for r in result.delta_sensitivity]
    assert deltas == [1e-4, 1e-3, 1e-2, 1e-1] and [r["fitted"] for r in result.delta_sensitivity] == [0, 0, 1, 0]
    doc = result.to_dict()
    assert doc["approach3"]["fit"]["huber_delta"] == 1e-2 and doc["approach3"]["alpha"] == result.delta_sensitivity[2][
        "alpha"]
    # least squares (large delta) is pulled by the outlier, the robust fits are not
    by_delta = {r["huber_delta"]: r for r in result.delta_sensitivity}
    assert abs(by_delta[1e-1]["alpha"] - 0.34) > 3 * abs(by_delta[1e-3]["alpha"] - 0.34)
    report = render_markdown(build_blocks(doc))
    assert "## Sensitivity to the Huber delta" in report and "| **0.01** |" in report
    out = tmp_path / "fit"
    assert main(["fit", str(tmp_path / "runs.csv"), "--out", str(out), "--bootstrap", "0", "--no-progress",
                 "--huber-delta", "0.01", "--no-holdout"]) == 0
    assert json.loads((out / "fit.json").read_text())["config"]["huber_delta"] == 0.01
    capsys.readouterr()


@pytest.mark.slow
def test_holdout_budgets_and_above_predict_each_held_out_run(tmp_path):
    table = load_runs(_csv(tmp_path, _runs()))
    base = {"n_bootstrap": 0, "progress": False, "delta_sensitivity": False}
    two = fit_runs(table, FitConfig(**base, holdout_budgets=2)).holdout
    assert two["n_holdout"] == 16 and two["n_train"] == 24 and "2 largest budgets" in two["held_out"]
    assert sorted({r["flops"] for r in two["approach3"]["runs"]}) == pytest.approx(BUDGETS[-2:])
    for r in two["approach3"]["runs"]:
        assert r["error"] == pytest.approx(r["predicted"] - r["loss"]) and abs(r["rel_error"]) < 0.05
    above = fit_runs(table, FitConfig(**base, holdout_above=float(BUDGETS[1]) * 1.5)).holdout
    assert above["n_holdout"] == 24 and "C above" in above["held_out"]
    assert above["isoflop"] is not None  # the largest budget is wholly held out: its N_opt is predicted too
    report = render_markdown(build_blocks(fit_runs(table, FitConfig(**base, holdout_budgets=2)).to_dict()))
    assert "| run | N | D | C | actual loss | predicted | error (nats) | rel error |" in report
    none = fit_runs(table, FitConfig(**base, holdout_above=1e30)).holdout
    assert none["skipped"] and "no run to hold out" in none["reason"]


def _png_width(data: bytes) -> int:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big")  # IHDR: width, then height


@pytest.mark.long
@pytest.mark.slow
def test_figures_in_every_format_at_200_dpi_and_tables_as_csv_and_latex(tmp_path, capsys):
    from analysis.synthetic import write_sweep

    write_sweep(_runs(), tmp_path / "sweep")
    out = tmp_path / "fit"
    assert main(["fit", str(tmp_path / "sweep"), "--out", str(out), "--bootstrap", "20", "--no-progress",
                 "--workers", "1", "--format", "svg,pdf"]) == 0
    for stem in ("isoflop", "allocation", "frontier", "contours", "residuals", "curves"):
        assert _png_width((out / f"{stem}.png").read_bytes()) >= 200 * 7  # every figure is at least 7 in wide
        assert (out / f"{stem}.svg").read_text().lstrip().startswith("<?xml")
        assert (out / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"
    doc = json.loads((out / "fit.json").read_text())
    tables = pd.read_csv(out / "tables.csv")
    assert list(tables.columns) == ["table", "row", "quantity", "value", "ci_low", "ci_high"]
    alpha = tables[(tables["table"] == "parameters") & (tables["quantity"] == "alpha")].iloc[0]
    assert alpha["value"] == doc["approach3"]["alpha"] and alpha["ci_low"] == doc["approach3"]["ci"]["alpha"][0]
    published = tables[tables["table"] == "published"]
    assert set(published["row"]) == {law.name for law in LAWS}
    assert published[(published["row"] == "Data-constrained law") & (published["quantity"] == "R_D*")][
        "value"].iloc[0] == 15.387
    assert len(tables[tables["table"] == "holdout"]) == 2 * doc["holdout"]["n_holdout"]
    tex = (out / "tables.tex").read_text()
    assert tex.count(r"\begin{tabular}") == 6 and r"\toprule" in tex
    assert f"approach 3 & {doc['approach3']['E']:.4g} [" in tex
    with pytest.raises(SystemExit) as stop:
        main(["fit", str(tmp_path / "sweep"), "--out", str(out), "--format", "png,gif"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: argument --format: unknown figure format(s) gif")


@pytest.mark.slow
def test_figures_stay_readable_at_20000_runs(tmp_path):
    import dataclasses

    import matplotlib.pyplot as plt
    from matplotlib.collections import PathCollection

    from analysis.plots import plot_allocation, plot_contours, plot_frontier, plot_isoflop, plot_residuals
    from analysis.synthetic import continuous_runs

    small = fit_runs(load_runs(_csv(tmp_path, _runs())), FitConfig(n_bootstrap=20, progress=False, holdout=False,
                                                                   delta_sensitivity=False))
    many = dataclasses.replace(small, table=load_runs(_csv(tmp_path, continuous_runs(20000, seed=1), "many.csv")))
    for maker in (plot_frontier, plot_contours, plot_residuals):
        fig = maker(many)
        dots = [c for ax in fig.axes for c in ax.collections
                if isinstance(c, PathCollection) and len(c.get_offsets()) == 20000]
        assert dots
        for runs in dots:
            assert runs.get_alpha() <= 0.1 and runs.get_sizes()[0] <= 2.0 and runs.get_rasterized()
            lines = [ln for ax in fig.axes for ln in ax.get_lines()]
            assert all(runs.get_zorder() < ln.get_zorder() for ln in lines)  # the fitted lines are drawn on top
        plt.close(fig)
    for maker in (plot_frontier, plot_contours, plot_isoflop, plot_allocation):
        fig = maker(small)
        fig.canvas.draw()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        assert legends
        for legend in legends:  # every legend lies below the plotting areas, off the data
            box = legend.get_window_extent()
            assert all(box.y1 <= ax.get_window_extent().y0 for ax in fig.axes[:1])
        labels = [t.get_text() for legend in legends for t in legend.get_texts()]
        if maker in (plot_frontier, plot_allocation):
            assert any(label.endswith("95% bootstrap band") for label in labels), labels
        plt.close(fig)
    fig = plot_frontier(many)
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert len(labels) >= 4, labels  # the loss axis, within a factor 3, is labelled every 0.5 or finer
    plt.close(fig)
    fig = plot_contours(small)
    assert fig.axes[0].texts and all(t.get_fontsize() >= 8 for t in fig.axes[0].texts)  # contour labels
    plt.close(fig)
    fig = plot_allocation(small)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    iso, a3 = lines["approach 2 (IsoFLOP)"], lines["approach 3 (parametric)"]
    assert iso.get_zorder() > a3.get_zorder() and iso.get_linewidth() > a3.get_linewidth()  # never hidden under 3
    plt.close(fig)


@pytest.mark.slow
def test_training_curves_figure_colours_each_run_by_its_size(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from analysis.plots import plot_curves
    from analysis.synthetic import write_sweep

    write_sweep(_runs(), tmp_path / "sweep")
    result = fit_runs(load_runs(tmp_path / "sweep"), QUICK)
    fig = plot_curves(result)
    tokens_ax, flops_ax = fig.axes[:2]
    assert (tokens_ax.get_xlabel(), flops_ax.get_xlabel()) == ("tokens seen", "compute spent C (FLOPs)")
    assert fig.axes[2].get_ylabel() == "parameters N"  # the colour bar
    for ax, field in ((tokens_ax, "tokens"), (flops_ax, "flops")):
        [lines] = [c for c in ax.collections if isinstance(c, LineCollection)]
        assert len(lines.get_segments()) == len(result.table.curves) == 40
        np.testing.assert_allclose(lines.get_segments()[0][:, 0], getattr(result.table.curves[0], field))
        colours = lines.get_colors()
        small, large = np.argmin([c.params for c in result.table.curves]), np.argmax(
            [c.params for c in result.table.curves])
        assert not np.allclose(colours[small], colours[large])
    plt.close(fig)


@pytest.mark.slow
def test_compare_overlays_a_fit_and_a_sweep_with_a_side_by_side_table(tmp_path, capsys):
    from analysis.published import LAWS as PUBLISHED
    from analysis.synthetic import write_sweep

    epoch = PUBLISHED[1].as_dict()
    assert main(["fit", str(_csv(tmp_path, _runs())), "--out", str(tmp_path / "chinchilla"), "--bootstrap", "20",
                 "--no-progress", "--workers", "1", "--no-holdout"]) == 0
    write_sweep(isoflop_runs(BUDGETS, per_budget=8, spread=6, noise=0.005, seed=1, law=epoch), tmp_path / "epoch")
    out = tmp_path / "compared"
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "chinchilla" / "fit.json"), str(tmp_path / "epoch"), "--out", str(out),
                 "--bootstrap", "20", "--workers", "1", "--format", "png,svg"]) == 0
    assert "wrote compare.csv, compare.html, compare.md" in capsys.readouterr().out
    table = pd.read_csv(out / "compare.csv", index_col="quantity")
    assert list(table.columns) == ["chinchilla", "epoch"] and table.loc["runs"].tolist() == ["40", "40"]
    first = json.loads((tmp_path / "chinchilla" / "fit.json").read_text())
    assert table.loc["approach 3: alpha", "chinchilla"].startswith(f"{first['approach3']['alpha']:.4g} [")
    assert float(table.loc["approach 3: beta", "epoch"].split()[0]) == pytest.approx(epoch["beta"], abs=0.03)
    for stem in ("compare_allocation", "compare_frontier"):
        assert _png_width((out / f"{stem}.png").read_bytes()) >= 1400 and (out / f"{stem}.svg").is_file()
    md = (out / "compare.md").read_text()
    assert "| quantity | chinchilla | epoch |" in md and "(compare_allocation.png)" in md

    import matplotlib.pyplot as plt

    from analysis import compare_fits as fits
    from analysis.plots import plot_compare_allocation, plot_compare_frontier

    entries = [fits.entry_from_fit("one", tmp_path / "chinchilla" / "fit.json"),
               fits.entry_from_fit("two", tmp_path / "chinchilla" / "fit.json")]
    fig = plot_compare_allocation(entries)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert sum(label.startswith("one: approach 3") for label in labels) == 2  # the law and its band
    assert sum(label.startswith("two: approach 3") for label in labels) == 2
    plt.close(fig)
    fig = plot_compare_frontier(entries)
    assert len(fig.axes[0].get_lines()) == 2
    plt.close(fig)
    assert main(["compare", str(tmp_path / "epoch"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "error: compare needs at least 2 inputs, got 1"


@pytest.mark.slow
def test_kaplan_form_is_fitted_beside_approach_3_on_request(tmp_path):
    from lab.measure.laws import KAPLAN

    rng = np.random.default_rng(0)
    n, d = np.exp(rng.uniform(np.log(1e7), np.log(1e10), 120)), np.exp(rng.uniform(np.log(1e9), np.log(1e11), 120))
    truth = np.array([np.log(8.8e13), np.log(5.4e13), 0.076, 0.095])  # the constants of Kaplan's L(N) and L(D)
    loss = np.exp(KAPLAN.log_loss(truth[None], np.log(n), np.log(d))[0] + 0.003 * rng.standard_normal(120))
    path = _csv(tmp_path, pd.DataFrame({"params": n, "tokens": d, "loss": loss}))
    result = fit_runs(load_runs(path), FitConfig(n_bootstrap=0, progress=False, holdout=False, law="kaplan",
                                                 delta_sensitivity=False))
    law = result.law
    assert law["form"] == "kaplan" and law["converged"]
    assert law["params"]["alpha_N"] == pytest.approx(0.076, abs=0.005)
    assert law["params"]["alpha_D"] == pytest.approx(0.095, abs=0.005)
    assert law["a"] == pytest.approx(0.095 / 0.171, abs=0.02)
    assert law["rmse_log_loss"] < 0.004 < law["approach3_rmse_log_loss"]  # the right form fits better
    doc = result.to_dict()
    report = render_markdown(build_blocks(doc))
    assert "## Another form: the kaplan law" in report and "| N_c | D_c | alpha_N | alpha_D |" in report
    assert fit_runs(load_runs(path), QUICK).law is None  # Chinchilla's form only by default


@pytest.mark.long
@pytest.mark.slow
def test_data_constrained_law_needs_unique_tokens_and_recovers_its_decay_constants(tmp_path, capsys):
    from lab.measure.laws import data_constrained_log_loss

    rng = np.random.default_rng(1)
    grid = [(n, d, d / epochs) for n in np.geomspace(1e7, 3e9, 5) for d in np.geomspace(1e9, 2e11, 4)
            for epochs in (1, 4, 16, 64)]
    n, d, unique = (np.array(v) for v in zip(*grid))
    truth = np.array([np.log(521.0), np.log(1488.0), np.log(1.87), 0.353, 0.353, np.log(15.387), np.log(5.309)])
    loss = np.exp(data_constrained_log_loss(truth, n, d, unique) + 0.002 * rng.standard_normal(len(n)))
    path = _csv(tmp_path, pd.DataFrame({"params": n, "tokens": d, "loss": loss, "U": unique}))
    out = tmp_path / "fit"
    args = ["fit", str(path), "--out", str(out), "--bootstrap", "0", "--no-progress", "--no-holdout",
            "--law", "data-constrained"]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("error: --law data-constrained needs each run's unique tokens")
    assert main(args + ["--column", "unique_tokens=U"]) in (0, 3)
    assert "data-constrained law: E=" in capsys.readouterr().out
    law = json.loads((out / "fit.json").read_text())["law"]
    assert law["params"]["R_D*"] == pytest.approx(15.387, rel=0.25)
    assert law["params"]["R_N*"] == pytest.approx(5.309, rel=0.25)
    assert law["params"]["alpha"] == pytest.approx(0.353, abs=0.02)
    assert law["rmse_log_loss"] < 0.003 < law["approach3_rmse_log_loss"]
    hint = fit_runs(load_runs(path, {"unique_tokens": "U"}), QUICK).warnings
    assert [c for c, _ in hint].count("unique_tokens") == 1  # Chinchilla's form only, with a pointer to --law


def test_the_default_isoflop_minimum_and_the_vertex_are_unbiased_on_a_drifting_grid():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_isoflop_bias", Path(__file__).resolve().parents[2]
                                                  / "benchmarks" / "isoflop-bias" / "bench_isoflop_bias.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    truth = 0.28 / (0.34 + 0.28)
    offsets = np.geomspace(1 / 3, 3, len(bench.BUDGETS))  # sizes planned from a too steep exponent
    found = bench.exponents(bench.CHINCHILLA, offsets, 8.0, 9, 0.0, 1, np.random.default_rng(0))
    bias = {k: abs(float(v[0]) - truth) for k, v in found.items()}
    assert max(bias["vertex"], bias["akima"]) < 0.001 < 0.004 < bias["hoffmann"] < bias["lowest"]
    assert FitConfig().isoflop_minimum == "akima"  # right on Porian et al.'s published setups


@pytest.mark.slow
def test_colour_bars_stay_opaque_when_the_runs_are_faint(tmp_path):
    import dataclasses

    import matplotlib.pyplot as plt

    from analysis.plots import plot_frontier, plot_residuals
    from analysis.synthetic import continuous_runs

    small = fit_runs(load_runs(_csv(tmp_path, _runs())), QUICK)
    many = dataclasses.replace(small, table=load_runs(_csv(tmp_path, continuous_runs(5000, seed=2), "many.csv")))
    for maker in (plot_frontier, plot_residuals):
        fig = maker(many)
        bar = fig.axes[-1]
        assert bar.get_ylabel() in ("parameters N", "compute C (FLOPs)")
        assert all(c.get_alpha() in (None, 1.0) for c in bar.collections + bar.images)
        plt.close(fig)
