"""Trackers: TensorBoard event files in the run folder, W&B offline continuing one run across a resume, and a
missing or failing tracker costing one warning line, never the run."""

import json
import time
from pathlib import Path

import pytest

from lab.training import trackers
from lab.commands.cli import run_main


class Failing:
    """A tracker that works for its first two records, then raises."""

    module = "json"

    def __init__(self, cfg, run_dir, config, resumed_at):
        self.calls = 0

    def log(self, step, values):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("the tracker's server went away\nsecond line")

    def summary(self, values):
        raise AssertionError("a dropped tracker was called again")

    def close(self):
        raise AssertionError("a dropped tracker was called again")


def run(run_dir: Path, args, *extra: str) -> int:
    return run_main([*args, "--train.tokens", "1024", *extra, "--run-dir", str(run_dir)])


def test_a_failing_or_missing_tracker_costs_one_warning_line(tmp_path, args, capsys, monkeypatch):
    monkeypatch.setitem(trackers.BACKENDS, "failing", Failing)
    monkeypatch.setitem(trackers.BACKENDS, "absent", type("Absent", (Failing,), {"module": "transformers_x"}))
    monkeypatch.setattr(trackers, "extra_of", lambda module: "tracking")
    assert run(tmp_path / "r", args, "--log.trackers", "failing,absent") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: tracker")]
    assert len(warnings) == 2
    assert "absent" in warnings[0] and "pip install -e '.[tracking]'" in warnings[0]
    assert "failing" in warnings[1] and "RuntimeError: the tracker's server went away" in warnings[1]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "completed"


def test_an_unknown_tracker_is_refused_before_the_run(tmp_path, args, capsys):
    assert run(tmp_path / "r", args, "--log.trackers", "tensorbaord") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean tensorboard" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.slow  # W&B starts its service process
def test_tensorboard_and_offline_wandb_follow_the_run_through_a_resume(tmp_path, args, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "sweep" / "runs" / "n1-d32"
    (tmp_path / "sweep" / "sweep.toml").parent.mkdir(parents=True)
    (tmp_path / "sweep" / "sweep.toml").write_text('[sweep]\nname = "iso-sweep-7"\n')
    options = ("--log.trackers", "tensorboard,wandb")
    assert run(run_dir, args, *options, "--train.stop_after", "2") == 0
    run_id = (run_dir / "wandb-id").read_text().strip()
    assert run(run_dir, args, *options, "--resume") == 0
    assert (run_dir / "wandb-id").read_text().strip() == run_id
    # W&B offline: both segments wrote into runs of the same id, named by the shape, grouped by the sweep
    segments = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(segments) == 2
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in losses] == [r["step"] for r in metrics if "loss" in r] == [1, 2, 3, 4]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in metrics if "loss" in r], rel=1e-6)
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu", "train/comm_time_s",
            "train/mem_peak_bytes", "eval/eval_loss"} <= set(events.Tags()["scalars"])
    assert "summary" in str(events.Tags()["tensors"]) and "config" in str(events.Tags()["tensors"])
    # the offline record of the last segment holds the sweep's name as its group, the config and the summary
    # (W&B's service may still be writing the record after finish() returned: give it a few seconds)
    keys, deadline = (b"iso-sweep-7", b"d_model", b"train/loss", b"final_eval_loss"), time.monotonic() + 30
    while not all(k in (segments[-1] / f"run-{run_id}.wandb").read_bytes() for k in keys) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    record = (segments[-1] / f"run-{run_id}.wandb").read_bytes()
    assert all(key in record for key in keys), [k for k in keys if k not in record]
