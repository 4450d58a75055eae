"""Loading runs: formats, column mapping, derived columns, parameter counts, and bad tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis.cli import main
from analysis.synthetic import isoflop_runs, write_sweep
from analysis.table import MIN_RUNS, InputError, load_runs, parse_column_map


@pytest.fixture
def runs() -> pd.DataFrame:
    # 12 noise-free runs; flops is exactly 6ND, so derived columns can be compared exactly.
    return isoflop_runs(np.geomspace(1e18, 1e20, 3), per_budget=4, noise=0.0)


def _run_cli(argv: list[str]) -> int:
    """Exit code of the CLI, whether it returns or exits (argparse errors exit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def _write(frame: pd.DataFrame, path, kind: str) -> None:
    records = frame.to_dict("records")
    if kind == "csv":
        frame.to_csv(path, index=False)
    elif kind == "parquet":
        frame.to_parquet(path, index=False)
    elif kind == "json":
        path.write_text(json.dumps(records))
    elif kind == "json_runs":
        path.write_text(json.dumps({"runs": records}))
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("kind,suffix", [("csv", ".csv"), ("parquet", ".parquet"), ("json", ".json"),
                                         ("json_runs", ".json"), ("jsonl", ".jsonl")])
def test_every_format_loads_the_same_runs(tmp_path, runs, kind, suffix):
    path = tmp_path / f"runs{suffix}"
    _write(runs, path, kind)
    table = load_runs(path)
    assert list(table.runs["run_id"]) == list(runs["run_id"])
    for col in ("params", "tokens", "flops", "loss"):
        np.testing.assert_allclose(table.runs[col], runs[col], rtol=1e-12)
    assert table.params_count == "total"


def test_column_mapping_renames_columns(tmp_path, runs):
    renamed = runs.rename(columns={"params": "n_params", "tokens": "n_tokens", "loss": "val_loss"})
    renamed["loss"] = 99.0  # an unrelated column called loss is replaced by the mapped one
    path = tmp_path / "runs.csv"
    renamed.to_csv(path, index=False)
    mapping = parse_column_map(["params=n_params", "tokens=n_tokens", "loss=val_loss"])
    table = load_runs(path, mapping)
    np.testing.assert_allclose(table.n, runs["params"])
    np.testing.assert_allclose(table.loss, runs["loss"])
    assert table.loss_source == "column 'val_loss'"
    with pytest.raises(InputError, match=r"column mapping loss=nope: no such column"):
        load_runs(path, {"loss": "nope"})
    with pytest.raises(InputError, match="expected NAME=COLUMN"):
        parse_column_map(["params"])
    with pytest.raises(InputError, match="NAME must be one of"):
        parse_column_map(["size=n_params"])


@pytest.mark.parametrize("drop", ["params", "tokens", "flops"])
def test_any_two_of_params_tokens_flops_suffice(tmp_path, runs, drop):
    path = tmp_path / "runs.csv"
    runs.drop(columns=[drop]).to_csv(path, index=False)
    table = load_runs(path)
    np.testing.assert_allclose(table.runs[drop], runs[drop], rtol=1e-12)
    assert any(drop in note for note in table.notes)
    assert table.params_count == ("derived (C/6D)" if drop == "params" else "total")


def test_params_count_picks_the_column(tmp_path, runs):
    runs = runs.assign(params_non_embedding=runs["params"] * 0.7)
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    total = load_runs(path)
    assert total.params_count == "total"
    np.testing.assert_allclose(total.n, runs["params"])
    nonemb = load_runs(path, params_count="non_embedding")
    assert nonemb.params_count == "non_embedding"
    np.testing.assert_allclose(nonemb.n, runs["params_non_embedding"])
    # The given flops are kept whichever count is used.
    np.testing.assert_allclose(nonemb.c, runs["flops"])
    runs.drop(columns=["params_non_embedding"]).to_csv(path, index=False)
    with pytest.raises(InputError, match="needs a 'params_non_embedding' column"):
        load_runs(path, params_count="non_embedding")


def _bad_tables():
    """(name, how to break the 12-run table, expected message)."""
    def set_value(col, value, row=2):
        def apply(f):
            f = f.astype({col: object}) if isinstance(value, str) else f.copy()
            f.loc[row, col] = value
            return f
        return apply
    return [
        ("no_loss", lambda f: f.drop(columns=["loss"]), r"missing column\(s\): need 'loss'"),
        ("one_of_three", lambda f: f.drop(columns=["tokens", "flops"]), r"missing column\(s\).*two of"),
        ("negative_params", set_value("params", -5.0), r"column 'params' has 1 non-positive value\(s\) \(run0002\)"),
        ("zero_tokens", set_value("tokens", 0.0), r"column 'tokens' has 1 non-positive value\(s\)"),
        ("nan_loss", set_value("loss", np.nan), r"column 'loss' has 1 missing or NaN value\(s\) \(run0002\)"),
        ("text_flops", set_value("flops", "lots"), r"column 'flops' has 1 non-numeric value\(s\)"),
        ("inf_loss", set_value("loss", np.inf), r"column 'loss' has 1 infinite value\(s\)"),
        ("too_few", lambda f: f.head(MIN_RUNS - 1), rf"need at least {MIN_RUNS} runs for a fit, got {MIN_RUNS - 1}"),
        ("one_size", lambda f: f.assign(params=1e8, flops=None).drop(columns=["flops"]),
         "at least 2 distinct values of params"),
    ]


@pytest.mark.parametrize("name,breaker,message", _bad_tables(), ids=[b[0] for b in _bad_tables()])
def test_bad_table_gives_its_error_and_the_cli_writes_nothing(tmp_path, runs, capsys, name, breaker, message):
    path = tmp_path / "runs.csv"
    breaker(runs).to_csv(path, index=False)
    with pytest.raises(InputError, match=message):
        load_runs(path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.json").write_text("earlier fit")
    rc = _run_cli(["fit", str(path), "--out", str(out), "--bootstrap", "10", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ")
    assert sorted(p.name for p in out.iterdir()) == ["fit.json"]
    assert (out / "fit.json").read_text() == "earlier fit"


@pytest.mark.parametrize("setup,message", [
    (lambda p: p.with_suffix(".txt").write_text("x"), "unsupported table format '.txt'"),
    (lambda p: p.with_suffix(".json").write_text('{"rows": 3}'), "expected a list of run records"),
    (lambda p: p.with_suffix(".jsonl").write_text('{"a": 1}\nnot json\n'), r"runs.jsonl:2: not valid JSON"),
])
def test_unreadable_files(tmp_path, setup, message):
    path = tmp_path / "runs.csv"
    setup(path)
    target = next(tmp_path.iterdir())
    with pytest.raises(InputError, match=message):
        load_runs(target)


def test_cli_rejects_missing_input_and_bad_options(tmp_path, capsys):
    out = tmp_path / "out"
    for argv, message in [
        (["fit", str(tmp_path / "nowhere.csv"), "--out", str(out)], "no such file or directory"),
        (["fit", str(tmp_path), "--out", str(out), "--ci", "1.5"], "interval level must be in (0, 1)"),
        (["fit", str(tmp_path), "--out", str(out), "--bootstrap", "lots"], "invalid int value"),
        (["fit", str(tmp_path)], "the following arguments are required: --out"),
    ]:
        assert _run_cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()


def test_sweep_folder_skips_unfinished_runs_and_falls_back_to_train_loss(tmp_path, runs):
    dirs = write_sweep(runs, tmp_path)
    failed = json.loads((dirs[0] / "summary.json").read_text())
    failed["status"] = "failed"
    (dirs[0] / "summary.json").write_text(json.dumps(failed))
    no_eval = json.loads((dirs[1] / "summary.json").read_text())
    no_eval["final_eval_loss"] = None
    (dirs[1] / "summary.json").write_text(json.dumps(no_eval))

    table = load_runs(tmp_path)
    assert len(table.runs) == len(runs) - 1
    assert runs["run_id"][0] not in set(table.runs["run_id"])
    codes = dict(table.warnings)
    assert "run0000 (failed)" in codes["runs_skipped"]
    assert "run0001" in codes["eval_loss_missing"]
    row = table.runs.index[table.runs["run_id"] == "run0001"][0]
    assert table.loss[row] == pytest.approx(no_eval["final_train_loss"])
    assert "final_train_loss" in table.loss_source


def test_sweep_folder_prefers_results_csv_and_reads_curves_from_run_dirs(tmp_path, runs):
    dirs = write_sweep(runs, tmp_path / "runs")
    table_csv = runs.assign(run_dir=[str(d.relative_to(tmp_path)) for d in dirs], loss=runs["loss"] + 1.0)
    table_csv.to_csv(tmp_path / "results.csv", index=False)
    table = load_runs(tmp_path)
    np.testing.assert_allclose(table.loss, runs["loss"] + 1.0)  # from results.csv, not the summaries
    assert len(table.curves) == len(runs)
    # FLOPs at a record = flops / tokens * record tokens, so the last record spent the run's flops.
    for curve in table.curves:
        assert curve.flops[-1] == pytest.approx(table.c[curve.row], rel=1e-9)


def test_sweep_folder_errors(tmp_path, runs):
    with pytest.raises(InputError, match="no results.csv and no run directories"):
        load_runs(tmp_path)
    dirs = write_sweep(runs.head(7), tmp_path)
    summary = json.loads((dirs[3] / "summary.json").read_text())
    del summary["tokens"]
    (dirs[3] / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(InputError, match=r"run0003/summary.json: missing key\(s\) tokens"):
        load_runs(tmp_path)
    (dirs[3] / "summary.json").write_text("{broken")
    with pytest.raises(InputError, match="run0003/summary.json: cannot read"):
        load_runs(tmp_path)


def test_task_scores_beside_the_summaries_become_a_column_per_task(tmp_path, runs):
    dirs = write_sweep(runs.head(6), tmp_path)
    for i, d in enumerate(dirs[:5]):  # the sixth run was never scored
        (d / "eval.json").write_text(json.dumps({"tasks": {"tiny": {"step": 8, "metrics": {
            "acc": 0.1 * i, "acc_stderr": 0.01}}}}))
    table = load_runs(tmp_path)
    scores = dict(zip(table.runs["run_id"], table.runs["task_tiny"]))
    assert [scores[f"run{i:04d}"] for i in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert np.isnan(scores["run0005"])
