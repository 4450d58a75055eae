"""Hand-edited or binary inputs to the analysis end with one line and exit 2 (issue 32)."""

import copy
import json
from pathlib import Path

import pytest

from analysis.cli import main
from analysis.synthetic import isoflop_runs


@pytest.fixture(scope="module")
def fit_doc(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fit")
    isoflop_runs((1e17, 3e17, 1e18, 3e18), per_budget=9, spread=6, noise=0.005, seed=0).to_csv(root / "runs.csv",
                                                                                                 index=False)
    assert main(["fit", str(root / "runs.csv"), "--out", str(root / "fit"), "--bootstrap", "0", "--no-progress"]) == 0
    return json.loads((root / "fit" / "fit.json").read_text())


def _edited(doc: dict, edit: str) -> dict | bytes:
    doc = copy.deepcopy(doc)
    if edit == "binary":
        return b"\xff\xfe{}"
    if edit == "no comparison":
        del doc["comparison"]
    if edit == "no data":
        del doc["data"]
    if edit == "a string":
        doc["approach3"]["a"] = "abc"
    if edit == "a huge exponent":
        doc["approach3"]["k_N"] = 1e308
    return doc


@pytest.mark.parametrize("edit, message", [
    ("binary", "cannot read fit"), ("no comparison", "'comparison' is missing or not an object"),
    ("no data", "'data' is missing or not an object"),
    ("a string", "approach3.a must be a finite number or null, got 'abc'"),
    ("a huge exponent", "approach3.k_N must be a finite number or null, got 1e+308"),
])
@pytest.mark.slow
def test_a_hand_edited_fit_json_gets_one_line(fit_doc, tmp_path, capsys, edit, message):
    bad = tmp_path / "bad" / "fit.json"
    bad.parent.mkdir()
    good = tmp_path / "good" / "fit.json"
    good.parent.mkdir()
    good.write_text(json.dumps(fit_doc))
    edited = _edited(fit_doc, edit)
    bad.write_bytes(edited if isinstance(edited, bytes) else json.dumps(edited).encode())
    for argv in (["plan", str(bad), "--gpu", "h100", "--n-gpus", "8", "--mfu", "0.4", "--flops", "1e21"],
                 ["compare", str(bad), str(good), "--out", str(tmp_path / "cmp")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "cmp").exists()


def test_a_binary_table_gets_one_line(tmp_path, capsys):
    table = tmp_path / "runs.csv"
    table.write_bytes(b"\xff\xfe\x00\x01binary")
    assert main(["fit", str(table), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: cannot read")
    assert not Path(tmp_path / "out").exists()
