"""The training loop end to end on real text: the run directory, determinism, bitwise resume,
gradient accumulation, divergence handling, bad input, two ranks, sampling."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.measure import accounting

from lab.runtime import checkpoint
from lab.commands.cli import run_main, sample_main
from lab.runtime.config import ConfigError, RunConfig, build_parser, config_from_args, resolve
from lab.model import GPT
from pool import run_pooled
from lab.training.plan import plan_run
from lab.training.steps import checkpoint_interval
from test_checkpoints import train_argv

ROOT = Path(__file__).resolve().parents[1]


def run(run_dir: Path, *argv: str) -> int:
    return run_main([*argv, "--run-dir", str(run_dir)])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


def final_state(run_dir: Path) -> dict:
    """Everything the newest checkpoint holds (weights, AdamW moments and steps), whole."""
    return checkpoint.load_everything(checkpoint.latest(run_dir))


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_run_directory_contract(tmp_path, args):
    assert run(tmp_path / "r", *args) == 0
    r = tmp_path / "r"
    cfg = RunConfig.from_dict(json.loads((r / "config.json").read_text()))
    assert cfg.model.vocab_size == 512 and cfg.model.d_model == 32  # fully resolved
    records = metrics(r)
    steps = [x for x in records if "loss" in x]
    assert [x["step"] for x in steps] == list(range(1, 9))
    for field in ("step", "tokens", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu",
                  "mem_peak_bytes", "machine_loopback_tx_bytes"):
        assert all(field in x for x in steps), field
    assert steps[-1]["tokens"] == 2048 and 0 < steps[-1]["mfu"] < 1
    evals = [x for x in records if "eval_loss" in x]
    assert evals and evals[-1]["step"] == 8
    s = json.loads((r / "summary.json").read_text())
    counts = accounting.param_counts(cfg.model)
    assert s["status"] == "completed" and s["strategy"] == "single" and s["world_size"] == 1
    assert (s["params"], s["params_non_embedding"]) == (counts.total, counts.non_embedding)
    assert s["tokens"] == 2048 and s["flops"] == accounting.flops_per_token(cfg.model) * 2048
    assert s["final_eval_loss"] == evals[-1]["eval_loss"] and s["final_train_loss"] > 0 and s["wall_time_s"] > 0
    assert (r / "checkpoints" / "step-000008" / "meta.json").is_file()
    assert (r / "checkpoints" / "step-000008" / ".metadata").is_file()  # torch.distributed.checkpoint's
    assert (r / "tokenizer").is_dir()


@pytest.mark.slow
def test_same_seed_gives_the_same_losses(tmp_path, args):
    assert run(tmp_path / "a", *args) == 0
    assert run(tmp_path / "b", *args) == 0
    assert run(tmp_path / "c", *args, "--train.seed", "2") == 0
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    assert_states_equal(final_state(tmp_path / "a"), final_state(tmp_path / "b"))
    assert train_losses(tmp_path / "a") != train_losses(tmp_path / "c")


@pytest.mark.slow
def test_interrupted_then_resumed_run_is_bitwise_identical(tmp_path, args):
    assert run(tmp_path / "full", *args) == 0
    part = tmp_path / "part"
    assert run(part, *args, "--train.stop_after", "3") == 0
    assert json.loads((part / "summary.json").read_text())["status"] == "stopped"
    assert run(part, *args, "--resume") == 0
    assert json.loads((part / "summary.json").read_text())["status"] == "completed"
    assert train_losses(part) == train_losses(tmp_path / "full")
    assert [x["step"] for x in metrics(part) if "loss" in x] == list(range(1, 9))
    assert_states_equal(final_state(part), final_state(tmp_path / "full"))


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(tmp_path, args):
    assert run(tmp_path / "accum1", *args, "--train.micro_batch", "8") == 0
    assert run(tmp_path / "accum4", *args, "--train.micro_batch", "2") == 0
    a, b = train_losses(tmp_path / "accum1"), train_losses(tmp_path / "accum4")
    assert a == pytest.approx(b, rel=1e-4)


@pytest.mark.slow
def test_wsd_schedule_and_modern_arch_train(tmp_path, args):
    assert run(tmp_path / "m", *args, "--model.arch", "modern", "--model.n_kv_head", "1",
               "--train.schedule", "wsd") == 0
    losses = train_losses(tmp_path / "m")
    assert losses[-1] < losses[0]
    lrs = [x["lr"] for x in metrics(tmp_path / "m") if "lr" in x]
    assert lrs[-1] == pytest.approx(1e-3)  # min_lr_ratio 0.1 of 1e-2


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, args, monkeypatch, capsys):
    calls = {"n": 0}
    forward = GPT.forward

    def poisoned(self, idx, targets=None):
        calls["n"] += 1
        out = forward(self, idx, targets)
        return out * float("nan") if targets is not None and calls["n"] > 2 * 5 else out  # step 6 onward

    monkeypatch.setattr(GPT, "forward", poisoned)
    r = tmp_path / "nan"
    assert run(r, *args, "--train.checkpoint_every", "2") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: loss is nan at step 6")
    assert "step-000004" in err[0]
    assert json.loads((r / "summary.json").read_text())["status"] == "diverged"
    assert [p.name for p in sorted((r / "checkpoints").glob("step-*"))] == ["step-000002", "step-000004"]
    assert checkpoint.load_everything(r / "checkpoints" / "step-000004")["optim/wte.weight/step"] == 4  # intact


@pytest.mark.parametrize("extra, message", [
    (["--model.n_head", "3"], "model.n_head (3) must divide model.d_model (32)"),
    (["--train.batch_tokens", "100"], "train.batch_tokens (100) is not a multiple of"),
    (["--model.preset", "gpt-5"], "unknown model preset 'gpt-5'"),
    (["--strategy", "zero9"], "unknown strategy 'zero9'"),
    (["--data.corpus", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["--data.tokenizer", "wordpiece"], "wordpiece"),
    (["--train.schedule", "step"], "train.schedule must be one of"),
    (["--model.vocab_size", "100"], "model.vocab_size (100) is smaller than the tokenizer's (512)"),
    (["--resume"], "no complete checkpoint"),
    (["--train.memory_meter", "true", "--train.compile", "true"], "train.memory_meter cannot run with train.compile"),
])
def test_bad_input_fails_before_training_with_one_line(tmp_path, args, capsys, extra, message):
    r = tmp_path / "bad"
    assert run(r, *args, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (r / "metrics.jsonl").exists() and not (r / "checkpoints").exists()


def test_single_strategy_refuses_several_processes(tmp_path, args, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run(tmp_path / "r", *args) == 2
    assert "strategy 'single' runs on at most 1 process(es), got world size 2: choose a data-parallel --strategy" in (
        capsys.readouterr().err)


def demo(*overrides: str) -> RunConfig:
    """configs/demo.toml with dotted overrides, as the command line resolves them."""
    args = build_parser("test", "").parse_args(["--config", str(ROOT / "configs" / "demo.toml"), *overrides])
    return config_from_args(args)


def test_the_demo_config_runs_on_one_and_two_ranks():
    assert plan_run(demo(), 1).steps.accum_steps == 2
    assert plan_run(demo("--strategy", "ddp"), 2).steps.accum_steps == 1


@pytest.mark.parametrize("overrides, message", [
    # the demo's earlier micro-batch, 16 sequences, on 2 ranks: the batch does not divide, but the mistake is elsewhere
    (["--parallel.ep", "2", "--strategy", "ddp"], "parallel.ep (2) splits a mixture of experts: set model.moe_experts"),
    (["--parallel.ep", "2"], "parallel.ep (2) splits a mixture of experts"),
    (["--strategy", "ddp", "--parallel.bucket_mb", "-1"], "parallel.bucket_mb must be positive, got -1.0"),
    (["--strategy", "zero4"], "unknown strategy 'zero4'"),
    ([], "strategy 'single' runs on at most 1 process(es), got world size 2: choose a data-parallel --strategy"),
    (["--strategy", "ddp"], "train.batch_tokens (4096) is not a multiple of train.micro_batch × model.block_size × "
                            "ranks (16 × 256 × 2 = 8192): set --train.micro_batch 8"),
    (["--strategy", "ddp", "--train.batch_tokens", "4000"], "set --train.batch_tokens to a multiple of 512"),
])
def test_a_batch_that_does_not_divide_is_named_last_with_the_option_that_fixes_it(overrides, message):
    with pytest.raises(ConfigError) as e:
        plan_run(demo("--train.micro_batch", "16", *overrides), 2)
    assert message in str(e.value)


def test_under_torchrun_an_unknown_strategy_is_named_before_the_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run(tmp_path / "r", "--config", str(ROOT / "configs" / "demo.toml"), "--train.micro_batch", "16",
               "--strategy", "zero4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown strategy 'zero4'") and "did you mean" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_existing_runs_are_never_overwritten_and_resume_checks_the_config(tmp_path, args, capsys):
    r = tmp_path / "r"
    assert run(r, *args, "--train.stop_after", "4") == 0  # a completed one is refused as complete (test_faults)
    before = (r / "metrics.jsonl").read_text()
    assert run(r, *args) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert run(r, *args, "--resume", "--model.d_model", "64") == 2
    assert "--resume cannot change model.d_model (the model, data, tokenizer and schedule" in capsys.readouterr().err
    assert (r / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_sample_continues_a_prompt(tmp_path, args, capsys):
    r = tmp_path / "r"
    assert run(r, *args) == 0
    capsys.readouterr()
    assert sample_main(["--run-dir", str(r), "--prompt", "Fellow citizens", "--tokens", "20", "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("Fellow citizens") and len(first) > len("Fellow citizens")
    assert sample_main(["--run-dir", str(r), "--prompt", "Fellow citizens", "--tokens", "20", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first
    assert sample_main(["--run-dir", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


@pytest.mark.long
@pytest.mark.slow
def test_bf16_autocast_path_runs_on_cpu(tmp_path, args):
    assert run(tmp_path / "bf16", *args, "--train.dtype", "bf16") == 0
    losses = train_losses(tmp_path / "bf16")
    fp32 = tmp_path / "fp32"
    assert run(fp32, *args) == 0
    assert losses == pytest.approx(train_losses(fp32), rel=0.05)


@pytest.mark.long
@pytest.mark.slow
def test_compiled_model_matches_eager(tmp_path, args):
    from torch._dynamo.utils import counters

    short = ["--model.n_layer", "1", "--train.tokens", "512", "--train.eval_tokens", "128"]  # compiling costs most
    assert run(tmp_path / "eager", *args, *short) == 0
    counters.clear()
    assert run(tmp_path / "compiled", *args, *short, "--train.compile", "true") == 0
    assert counters["stats"]["unique_graphs"] > 0  # compilation really happened
    assert train_losses(tmp_path / "compiled") == pytest.approx(train_losses(tmp_path / "eager"), rel=1e-4)


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(tmp_path, args, capsys):
    r = tmp_path / "r"
    assert run(r, *args) == 0
    summary = (r / "summary.json").read_text()
    assert run(r, *args, "--resume") == 2
    assert "already complete (8 steps)" in capsys.readouterr().err
    assert (r / "summary.json").read_text() == summary


@pytest.mark.long
@pytest.mark.slow
def test_launch_script_exits_2_with_one_line_on_bad_input(tmp_path, args):
    r = tmp_path / "bad"
    proc = subprocess.run([sys.executable, "launch/run.py", *args, "--model.n_head", "3", "--run-dir", str(r)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: model.n_head (3) must divide model.d_model (32)"
    assert not r.exists()


def test_checkpoints_come_about_ten_per_run_unless_set():
    """The tiny runs of these tests set their interval (conftest.TINY_RUN); the default is this."""
    unset, every_3, at_the_end = (resolve({"train": {"checkpoint_every": n}}) for n in (None, 3, 0))
    assert [checkpoint_interval(unset, steps) for steps in (1, 8, 100, 1001)] == [1, 1, 10, 101]
    assert (checkpoint_interval(every_3, 100), checkpoint_interval(at_the_end, 100)) == (3, 0)


@pytest.mark.slow
def test_resume_auto_restarts_a_run_stopped_before_its_first_checkpoint(tmp_path, args, capsys):
    full, r = tmp_path / "full", tmp_path / "r"
    assert run(full, *args) == 0
    assert run(r, *args, "--train.stop_after", "3", "--train.checkpoint_every", "0") == 0
    shutil.rmtree(r / "checkpoints")  # as if killed before the first checkpoint
    assert run(r, *args) == 2
    assert "--resume auto" in capsys.readouterr().err
    assert run(r, *args, "--resume", "auto") == 0
    assert train_losses(r) == train_losses(full)
    assert [x["step"] for x in metrics(r) if "loss" in x] == list(range(1, 9))


@pytest.mark.slow
def test_resume_auto_continues_from_the_newest_checkpoint_and_drops_a_torn_line(tmp_path, args):
    full, r = tmp_path / "full", tmp_path / "r"
    assert run(full, *args) == 0
    assert run(r, *args, "--train.stop_after", "4") == 0
    assert (r / "checkpoints" / "step-000004").is_dir()  # where stop_after stopped
    with (r / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "tokens": 12')  # killed mid-write
    assert run(r, *args, "--resume", "auto") == 0
    assert train_losses(r) == train_losses(full)
    assert_states_equal(final_state(r), final_state(full))


TWO_RANK_STRATEGIES = ("ddp_naive", "ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, args):
    """The same config under single (one process) and each data-parallel strategy on 2 gloo ranks."""
    root = tmp_path_factory.mktemp("two-rank")
    args = (*args, "--train.memory_meter", "true")  # peak bytes per phase, measured by allocation
    assert run(root / "single", *args) == 0
    runs = {"single": root / "single"}
    for strategy in TWO_RANK_STRATEGIES:
        argv = [*args, "--strategy", strategy]
        assert run_pooled(train_argv, 2, argv, root / strategy) == ["completed"] * 2
        runs[strategy] = root / strategy
    return runs


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("strategy", TWO_RANK_STRATEGIES)
def test_torchrun_two_ranks_log_the_single_process_losses(two_rank_runs, strategy):
    single, got = metrics(two_rank_runs["single"]), metrics(two_rank_runs[strategy])
    assert [r["step"] for r in got if "loss" in r] == [r["step"] for r in single if "loss" in r] == list(range(1, 9))
    for a, b in zip((r for r in single if "loss" in r), (r for r in got if "loss" in r)):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
    summary = json.loads((two_rank_runs[strategy] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    for key in ("model_state_bytes", "model_state_bytes_theory"):
        assert set(summary[key]) == {"params", "grads", "optimizer", "total"}
    for key in ("comm_bytes_per_step", "comm_bytes_per_step_theory"):
        assert set(summary[key]) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    assert summary["comm_bytes_per_step"] == summary["comm_bytes_per_step_theory"]
    for kind in ("params", "grads", "optimizer", "total"):  # buffers excluded, step counters included
        assert summary["model_state_bytes"][kind] == pytest.approx(summary["model_state_bytes_theory"][kind], rel=0.05)
    assert summary["activation_saved_bytes"] > 0
    assert all(r["comm_time_s"] >= 0 and r["compute_time_s"] > 0 for r in got if "loss" in r)
    # peak bytes per phase, measured by allocation (lab.measure.memory), beside the kernel's peak RSS and the theory
    assert all(set(r["peak_bytes"]) == {"forward", "backward", "step", "rss"} for r in got if "loss" in r)
    assert set(summary["peak_bytes"]) == {"forward", "backward", "step", "rss"}
    assert set(summary["peak_bytes_theory"]) == {"forward", "backward", "step"}
    assert summary["model_state_bytes"]["total"] < summary["peak_bytes"]["step"] < summary["peak_bytes"]["rss"]


@pytest.mark.long
@pytest.mark.slow
def test_each_zero_stage_shows_its_saving(two_rank_runs):
    """Per rank on 2 ranks: zero1 halves optimizer states, zero2 also gradients, zero3 also parameters."""
    state = {s: json.loads((two_rank_runs[s] / "summary.json").read_text())["model_state_bytes"]
             for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    half = lambda strategy, kind: state[strategy][kind] / state["ddp"][kind]  # noqa: E731
    assert half("zero1", "optimizer") == pytest.approx(0.5, rel=0.02) and half("zero1", "grads") == 1
    assert half("zero2", "optimizer") == pytest.approx(0.5, rel=0.02)
    assert half("zero2", "grads") == pytest.approx(0.5, rel=0.02)
    assert half("zero2", "params") == pytest.approx(1, rel=0.01)
    for strategy in ("zero3", "fsdp"):
        assert all(half(strategy, kind) == pytest.approx(0.5, rel=0.02) for kind in ("params", "grads", "optimizer"))
    # and at the peak, measured by allocation (this model is mostly embedding, zero3's root unit: see test_sharding)
    peak = {s: json.loads((two_rank_runs[s] / "summary.json").read_text())["peak_bytes"]["backward"]
            for s in ("ddp", "zero1", "zero2", "zero3")}
    assert max(peak["zero2"], peak["zero3"]) < peak["zero1"] < peak["ddp"], peak


@pytest.mark.long
@pytest.mark.slow
def test_single_runs_write_the_meters_too(two_rank_runs):
    summary = json.loads((two_rank_runs["single"] / "summary.json").read_text())
    assert summary["model_state_bytes"]["total"] == pytest.approx(16 * summary["params"], rel=0.05)
    assert set(summary["comm_bytes_per_step"].values()) == {0.0}


@pytest.mark.long
@pytest.mark.slow  # five tiny runs of 40 steps
def test_expect_warns_once_when_a_run_goes_off_track_and_never_when_on_track(tmp_path, args, monkeypatch, capsys):
    """A curve law fitted on three tiny runs (widths 16, 32, 48); a new seed of the middle one stays on track, the
    same run with its learning rate x10 from step 20 warns once, in the log, metrics.jsonl and summary.json."""
    from analysis.curves import fit_curves, load_curves
    from lab.training import schedule

    long = ("--train.tokens", str(40 * 256), "--train.eval_every", "2", "--train.checkpoint_every", "0")
    for width in (16, 32, 48):
        assert run(tmp_path / "law-runs" / f"d{width}", *args, *long, "--model.d_model", str(width)) == 0
    curves, _ = load_curves([tmp_path / "law-runs"])
    law = tmp_path / "curves.json"
    law.write_text(json.dumps({"fit": fit_curves(curves, n_bootstrap=20).to_dict()}))
    capsys.readouterr()
    on = tmp_path / "on"
    assert run(on, *args, *long, "--train.seed", "7", "--train.expect", str(law)) == 0
    out = capsys.readouterr().out
    assert "OFF TRACK" not in out and "| expected " in out
    summary = json.loads((on / "summary.json").read_text())["expect"]
    assert summary["off_track_at_step"] is None and summary["evals"] == 20

    rate = schedule.learning_rate
    monkeypatch.setattr(schedule, "learning_rate", lambda step, total, cfg: rate(step, total, cfg) * (
        10.0 if step >= 20 else 1.0))
    off = tmp_path / "off"
    assert run(off, *args, *long, "--train.seed", "7", "--train.expect", str(law)) == 0
    out = capsys.readouterr().out
    assert out.count("warning: OFF TRACK") == 1
    summary = json.loads((off / "summary.json").read_text())["expect"]
    assert summary["off_track_at_step"] is not None and summary["off_track_at_step"] > 20
    warned = [r for r in metrics(off) if "warning" in r]
    assert len(warned) == 1 and warned[0]["step"] == summary["off_track_at_step"]
    # a law that is not one is refused before any work
    assert run(tmp_path / "bad", *args, "--train.expect", str(tmp_path / "missing.json")) == 2
    assert "train.expect: cannot read the law" in capsys.readouterr().err


@pytest.mark.long
def test_the_forward_peak_under_bf16_autocast_holds_the_cast_weights_as_theory_says(tmp_path):
    """bf16 autocast keeps a bf16 copy of every matmul weight from the forward to the backward (an H100 run's
    forward peak was 18 % above a theory without them); weights dominate this model, so the copies show."""
    common = ["--model.n_layer", "2", "--model.d_model", "256", "--model.n_head", "4", "--model.block_size", "64",
              "--data.tokenizer", "bytes", "--train.micro_batch", "2", "--train.batch_tokens", "128",
              "--train.tokens", "256", "--train.eval_tokens", "128", "--train.checkpoint_every", "0",
              "--train.memory_meter", "true"]
    gaps = {}
    for dtype in ("fp32", "bf16"):
        assert run_main([*common, "--train.dtype", dtype, "--run-dir", str(tmp_path / dtype)]) == 0
        summary = json.loads((tmp_path / dtype / "summary.json").read_text())
        gaps[dtype] = summary["peak_bytes"]["forward"] / summary["peak_bytes_theory"]["forward"] - 1
    cfg = resolve({"model": {"n_layer": 2, "d_model": 256, "n_head": 4, "block_size": 64, "vocab_size": 257}}).model
    cast = accounting.autocast_weight_bytes(cfg)  # 2 B × 1.6M matmul weights: 12 % of this forward's peak
    assert abs(gaps["fp32"]) < 0.03 and abs(gaps["bf16"]) < 0.03, gaps
    assert cast > 0.1 * summary["peak_bytes_theory"]["forward"]  # without it, the bf16 gap would exceed 10 %


def test_the_off_track_warning_is_one_short_line_whatever_the_laws_path():
    import numpy as np

    from lab.training.expect import OFF_TRACK_EVALS, Watcher

    law = "/" + "a-long-folder-name/" * 12 + "fit.json"
    watcher = Watcher(law, "fit", np.full(100, 1e-3), lambda step: (2.0, 1.9, 2.1))
    said = [watcher.observe(step, 5.0)[1] for step in range(10, 10 * (OFF_TRACK_EVALS + 1), 10)]
    line = f"warning: {said[-1]}"
    assert said[:-1] == [None] * (OFF_TRACK_EVALS - 1) and line.startswith("warning: OFF TRACK: the eval loss")
    assert "\n" not in line and len(line) <= 200 and "a-long-folder-name" not in line  # the law: in summary.json
