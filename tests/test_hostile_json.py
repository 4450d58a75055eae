"""Hostile JSON (issue 32): a file the lab's commands read as JSON that holds binary or non-UTF-8 bytes, or a
records file with such a line, gives one ``error:`` line and exit 2 (no traceback), or for a records file a
skipped line; everything here runs in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

BINARY = b"\x80\x81\xfe\xff\x00PK\x03\x04 not text"
LATIN1 = '{"run_id": "caf\xe9"}'.encode("latin-1")


def _run_folder(root: Path, name: str, **files: bytes) -> Path:
    """A run folder whose config.json and summary.json are valid unless ``files`` replaces them."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"tokens": 2048, "batch_tokens": 256, "lr": 0.01}}))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 8}))
    for file, data in files.items():
        (run / file.replace("_", ".")).write_bytes(data)
    return run


def _analysis(tmp_path: Path, case: str) -> list[str]:
    if case == "summary.json in a sweep folder":
        _run_folder(tmp_path / "sweep" / "runs", "a", summary_json=BINARY)
        return ["fit", str(tmp_path / "sweep"), "--out", str(tmp_path / "fit")]
    if case == "a .json table":
        (tmp_path / "runs.json").write_bytes(BINARY)
        return ["fit", str(tmp_path / "runs.json"), "--out", str(tmp_path / "fit")]
    if case == "a .jsonl table":
        (tmp_path / "runs.jsonl").write_bytes(b'{"params": 1e6}\n' + LATIN1 + b"\n")
        return ["fit", str(tmp_path / "runs.jsonl"), "--out", str(tmp_path / "fit")]
    if case == "config.json of a run (curves)":
        run = _run_folder(tmp_path, "r", config_json=LATIN1)
        return ["curves", str(run), "--out", str(tmp_path / "curves")]
    if case == "config.json of a run (watch)":
        run = _run_folder(tmp_path, "r", config_json=BINARY)
        (tmp_path / "curves.json").write_text("{}")
        return ["watch", str(run), "--law", str(tmp_path / "curves.json")]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["summary.json in a sweep folder", "a .json table", "a .jsonl table",
                                  "config.json of a run (curves)", "config.json of a run (watch)"])
def test_analysis_refuses_binary_json_in_one_line(case, tmp_path, capsys):
    from analysis.cli import main

    argv = _analysis(tmp_path, case)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and not (tmp_path / "fit").exists()


@pytest.fixture(scope="module")
def stopped_run(args, tmp_path_factory) -> Path:
    """A tiny run stopped after its step-4 checkpoint (as a kill would leave it: no summary.json)."""
    from lab.commands.cli import run_main

    run = tmp_path_factory.mktemp("stopped") / "r"
    assert run_main([*args, "--run-dir", str(run)]) == 0
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000008")
    return run


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "sample", "resume"])
@pytest.mark.parametrize("data", [BINARY, LATIN1], ids=["binary", "latin-1"])
def test_lab_refuses_a_run_whose_config_json_is_not_utf8_json(command, data, args, stopped_run, tmp_path, capsys):
    from lab.commands.cli import export_main, run_main, sample_main

    run = tmp_path / "r"
    shutil.copytree(stopped_run, run)
    (run / "config.json").write_bytes(data)
    before = sorted(p.name for p in run.rglob("*"))
    main = {"export": export_main, "sample": sample_main, "resume": run_main}[command]
    argv = [*args, "--run-dir", str(run), "--resume"] if command == "resume" else [str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "config.json" in err, err
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written


@pytest.mark.slow
def test_a_resumed_run_skips_a_metrics_line_that_is_not_utf8(args, stopped_run, tmp_path, capsys):
    from lab.commands.cli import run_main

    run = tmp_path / "r"
    shutil.copytree(stopped_run, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(BINARY + b"\n")
    assert run_main([*args, "--run-dir", str(run), "--resume"]) == 0
    def steps(folder: Path) -> list[int]:
        return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert steps(run) == steps(stopped_run)  # the records of the whole run, once each, the bad line gone


def test_a_checkpoints_meta_json_not_utf8_is_refused_in_one_line(tmp_path):
    from lab.runtime import checkpoint
    from lab.runtime.config import ConfigError

    folder = tmp_path / "step-000004"
    folder.mkdir()
    (folder / checkpoint.META).write_bytes(BINARY)
    with pytest.raises(ConfigError, match=r"unreadable \(meta.json: .*not UTF-8 text"):
        checkpoint.read_meta(folder)


def test_sweeps_read_binary_json_without_a_traceback(tmp_path):
    from sweeps.centre import fit_law
    from sweeps.executors.attempt import read_summary
    from sweeps.spec import SpecError

    run = _run_folder(tmp_path, "r", summary_json=BINARY)
    assert read_summary(run) is None  # the driver sees a run that has not finished
    (tmp_path / "fit.json").write_bytes(LATIN1)
    sweep = SimpleNamespace(centre=SimpleNamespace(path=tmp_path / "fit.json", approach="preferred"))
    with pytest.raises(SpecError, match=r"^\[sweep\] centre: .*fit.json: cannot read \(.*not UTF-8 text"):
        fit_law(sweep)


def test_records_files_with_non_utf8_lines_lose_those_lines_only(tmp_path):
    """metrics.jsonl (read by analysis's table and curves, and by a resumed run, above): a line that is not UTF-8
    spoils itself only, and the readers skip it like a torn line."""
    from lab.runtime.files import read_lines

    run = _run_folder(tmp_path, "r")
    good = [json.dumps({"step": s, "tokens": 256 * s, "eval_loss": 5.0 - s / 10}) for s in range(1, 9)]
    (run / "metrics.jsonl").write_bytes("\n".join(good[:4]).encode() + b"\n" + BINARY + b"\n"
                                        + "\n".join(good[4:]).encode() + b"\n")
    assert [json.loads(line) for line in read_lines(run / "metrics.jsonl") if line.startswith("{")] == \
        [json.loads(line) for line in good]
