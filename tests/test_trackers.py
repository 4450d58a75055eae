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


@pytest.mark.slow
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


@pytest.mark.long
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
    assert run(run_dir, args, *options, "--train.stop_after", "3", *off_track(tmp_path)) == 0  # warns at step 3
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
    # the first segment's record holds its off-track warning: the alert, and the summary's warning field
    first = (segments[0] / f"run-{run_id}.wandb").read_bytes()
    assert b"n1-d32: OFF TRACK" in first and b"step 3: OFF TRACK: the eval loss" in first and b"warning_step" in first


def off_track(folder: Path) -> tuple[str, ...]:
    """Options that make a tiny run go off track at its third eval (step 3): evals at every step against a curves law
    (folder/curves.json) that expects about 1.1 nats where the run's loss sits near 6."""
    from analysis.curves import CurveFit
    from lab.measure.laws import curve_theta

    law = CurveFit(theta=curve_theta({"E": 1.0, "B": 1.0, "beta": 0.5, "A": 0.1, "alpha": 0.5, "C": 1e-9,
                                     "lambda": 0.5, "K": 1e-9, "tau": 1.0}),
                   thetas=None, converged=True, rmse_log_loss=0.0, n_runs=1, n_points=1, level=0.95)
    (folder / "curves.json").write_text(json.dumps({"fit": law.to_dict()}))
    return "--train.eval_every", "1", "--train.checkpoint_every", "0", "--train.expect", str(folder / "curves.json")


@pytest.mark.slow
def test_an_off_track_warning_reaches_tensorboard_once_even_across_a_resume(tmp_path, args, capsys):
    """A run outside the law's interval at every eval warns at its third (lab.training.expect.OFF_TRACK_EVALS).
    Stopped there and resumed, it does not warn again: summary.json counts both segments' evals and the one warning,
    and TensorBoard holds that warning once, at its step, beside every eval's expected loss and deviation."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, options = tmp_path / "r", ("--log.trackers", "tensorboard", *off_track(tmp_path))
    assert run(run_dir, args, *options, "--train.stop_after", "3") == 0
    assert capsys.readouterr().out.count("warning: OFF TRACK") == 1
    assert run(run_dir, args, *options, "--resume") == 0
    assert "OFF TRACK" not in capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())["expect"]
    assert (summary["evals"], summary["off_track_at_step"], summary["outside"]) == (4, 3, 4)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    alerts = events.Tensors("warnings/text_summary")
    assert [e.step for e in alerts] == [3]
    assert alerts[0].tensor_proto.string_val[0].decode().startswith("OFF TRACK: the eval loss has been outside")
    records = [r for r in metrics_of(run_dir) if "expected_loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("expected_loss", "deviation"):
        got = events.Scalars(f"eval/{key}")
        assert [e.step for e in got] == [r["step"] for r in records]
        assert [e.value for e in got] == pytest.approx([r[key] for r in records], rel=1e-6)

def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_trackers_get_the_router_and_the_expert_exchange_figures_of_each_step():
    from lab.training.trackers import RECORD_KEYS, numbers

    rec = {"step": 3, "loss": 2.5, "moe_router_entropy": 1.2, "ep_a2a_bytes": 524288, "ep_a2a_bytes_theory": 524288.0,
           "moe_tokens_per_expert": [10, 12], "pp_bubble": [0.4, 0.2]}
    assert numbers(rec, RECORD_KEYS) == {"loss": 2.5, "moe_router_entropy": 1.2, "ep_a2a_bytes": 524288,
                                         "ep_a2a_bytes_theory": 524288.0}  # lists stay in the metrics file
