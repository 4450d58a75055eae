"""A newcomer's first hour (issue 20): every strategy as a world of one, one error line with exit 2,
values that suggest what was meant, a peak that says when it was measured, one entry point."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.commands.cli import run_main
from lab.parallel import STRATEGIES

pytestmark = pytest.mark.slow  # launches processes or trains many runs: `make test` only, not test-fast

ROOT = Path(__file__).resolve().parents[1]


def run(run_dir: Path, *argv: str) -> int:
    return run_main([*argv, "--run-dir", str(run_dir)])


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def single_losses(args, tmp_path_factory) -> list[float]:
    r = tmp_path_factory.mktemp("single") / "r"
    assert run(r, *args, "--train.tokens", "768") == 0
    return losses(r)


# ---------------------------------------------------------------- every strategy as a world of one


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s not in ("single", "deepspeed")])
def test_every_strategy_runs_alone_under_plain_python_as_single_does(strategy, args, tmp_path, single_losses,
                                                                       monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert run(tmp_path / "r", *args, "--train.tokens", "768", "--strategy", strategy) == 0
    assert losses(tmp_path / "r") == single_losses


def test_the_headline_torchrun_command_runs_zero2_alone_and_warns_about_restarts(args, tmp_path, single_losses):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           "--max-restarts=1", "launch/run.py", "--strategy", "zero2", *args, "--train.tokens", "768",
                           "--run-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "PYTHONUNBUFFERED": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "r") == single_losses
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warnings[0]
    assert "pytorch/pytorch#135712" in warnings[0]


def test_no_restart_warning_when_the_store_is_not_shared_or_nothing_restarts(args, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert run(tmp_path / "a", *args, "--train.tokens", "256") == 0
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    assert run(tmp_path / "b", *args, "--train.tokens", "256") == 0
    assert "warning" not in capsys.readouterr().err


def test_a_run_that_failed_before_its_first_step_is_started_again_by_the_same_command(args, tmp_path, monkeypatch):
    import lab.training.train

    def broken(*a, **kw):
        raise RuntimeError("a bug in the first step")

    with monkeypatch.context() as m:
        m.setattr(lab.training.train, "train_step", broken)
        with pytest.raises(RuntimeError, match="a bug in the first step"):
            run(tmp_path / "r", *args, "--train.tokens", "512")
    assert run(tmp_path / "r", *args, "--train.tokens", "512") == 0
    assert len(losses(tmp_path / "r")) == 2


# ---------------------------------------------------------------- one error line, exit 2


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_only_the_first_rank_of_a_node_prints_the_error(args, tmp_path, monkeypatch, capsys):
    bad = ["--strategy", "ddp", "--train.batch_tokens", "256", "--train.micro_batch", "4"]  # 256 % (4·32·3) != 0
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in ("2", "1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert run(tmp_path / "r", *args, *bad) == 2
    assert "is not a multiple of train.micro_batch × model.block_size × ranks" in one_error_line(capsys.readouterr().err)
    for rank in ("1", "0"):  # the parser's own errors too
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(SystemExit, match="2"):
            run_main(["--train.tokn", "5"])
    assert "did you mean --train.tokens?" in one_error_line(capsys.readouterr().err)


def test_nproc_per_node_checks_the_run_for_its_ranks_before_starting_any(args, tmp_path, monkeypatch, capsys):
    import torch.distributed.run

    monkeypatch.setattr(torch.distributed.run, "run", lambda *a: pytest.fail("ranks started"))
    assert run(tmp_path / "r", *args, "--strategy", "ddp", "--nproc-per-node", "3") == 2
    assert "(4 × 32 × 3 = 384)" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


@pytest.mark.long
def test_bad_input_found_after_three_ranks_started_gives_one_line_and_exit_2(args, tmp_path):
    # the vocabulary is checked against the tokenizer, which every rank loads after the group has formed
    proc = subprocess.run([sys.executable, "-m", "lab", "train", "--nproc-per-node", "3", "--strategy", "ddp", *args,
                           "--train.batch_tokens", "384", "--model.vocab_size", "100", "--train.peak_flops", "1e12",
                           "--run-dir", str(tmp_path / "r")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_error_line(proc.stderr) == "error: model.vocab_size (100) is smaller than the tokenizer's (512)"


@pytest.mark.parametrize("strategy", [["--strategy", "zero3"],
                                      ["--strategy", "deepspeed", "--parallel.zero_stage", "3"]])
def test_compile_is_refused_up_front_where_unsupported(strategy, args, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert run(tmp_path / "r", *args, *strategy, "--train.compile", "true") == 2
    assert "train.compile is not supported under" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_a_negative_number_is_a_value_that_reaches_its_check(args, tmp_path, capsys):
    assert run(tmp_path / "r", *args, "--train.tokens", "-1e5") == 2
    assert one_error_line(capsys.readouterr().err) == "error: train.tokens must be positive, got -100000"


@pytest.mark.parametrize("extra, suggestion", [
    (["--strategy", "zer02"], "(did you mean zero2?)"),
    (["--model.preset", "tiny-modren"], "(did you mean tiny-modern?)"),
    (["--train.schedule", "cosin"], "(did you mean cosine?)"),
    (["--parallel.activation_checkpointing", "ful"], "(did you mean full?)"),
    (["--train.dtype", "bf61"], "(did you mean bf16?)"),
    (["--data.tokenizer", "byte"], "(did you mean bytes?)"),
])
def test_an_unknown_value_gets_a_suggestion(extra, suggestion, args, tmp_path, capsys):
    assert run(tmp_path / "r", *args, *extra) == 2
    assert one_error_line(capsys.readouterr().err).endswith(suggestion)


# ---------------------------------------------------------------- the peak: when, under what load, the best kept


def test_peak_remeasure_records_time_and_load_and_keeps_the_best(tmp_path, monkeypatch, capsys):
    from lab.measure import device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = iter([2e9, 5e9, 3e9, 4e9])  # fp32 then bf16, twice: bf16 reads lower the second time
    monkeypatch.setattr(device, "measure_matmul_peak", lambda dtype, budget_s: next(figures))
    monkeypatch.setattr(device.os, "getloadavg", lambda: (1.75, 1.0, 0.5))
    assert device.peak_main(["--remeasure", "--budget", "0.01"]) == 0
    assert device.peak_main(["--remeasure", "--budget", "0.01"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("bf16: 4.0 GFLOP/s now (") and "load 1.75 on" in out[-1]
    assert "; kept 5.0 GFLOP/s (measured " in out[-1]
    cache = json.loads((tmp_path / "scaling-lab" / "cpu-peaks.json").read_text())
    assert sorted(r["flops"] for r in cache.values()) == [3e9, 5e9] and {r["load"] for r in cache.values()} == {1.75}
    source = device.cpu_peak_flops(torch.bfloat16).source
    threads = f"{torch.get_num_threads()} thread"
    assert source.startswith(f"measured matmul peak ({threads}") and ", 20" in source and "load 1.75 on" in source
    assert device.peak_main([]) == 0 and f"bf16: 5.0 GFLOP/s (measured {threads}" in capsys.readouterr().out


def test_the_start_line_names_the_deepspeed_stage_and_the_peak():
    from lab.runtime.config import RunConfig
    from lab.measure.device import Peak, Precision
    from lab.parallel import World
    from lab.training.plan import create, plan_run
    from lab.training.runlog import start_line
    from lab.training.steps import loop_settings
    from lab.training.steps import Start

    cfg = RunConfig()
    cfg.model.vocab_size, cfg.parallel.strategy, cfg.parallel.zero_stage = 512, "deepspeed", 3
    world, plan, precision = World(0, 1, 0, torch.device("cpu")), plan_run(cfg, 1).steps, Precision("cpu")
    strategy = create(cfg.parallel, world, precision, loop_settings(cfg, plan))  # described before it is built
    line = start_line(cfg, world, plan, precision, Peak(3e11, "measured matmul peak (x)"), Start(), None,
                      strategy.describe())
    assert "strategy deepspeed (ZeRO stage 3) × 1" in line
    assert "peak 3e+11 FLOP/s (measured matmul peak (x))" in line


# ---------------------------------------------------------------- one entry point


def test_python_m_lab_lists_its_commands_and_runs_one():
    listing = subprocess.run([sys.executable, "-m", "lab", "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0
    for command in ("train", "sample", "export", "plan", "bench", "equivalence", "mup-check", "peak"):
        assert f"\n  {command} " in listing.stdout
    plan = subprocess.run([sys.executable, "-m", "lab", "plan", "time", "--params", "1e6", "--tokens", "2e7",
                           "--gpu", "h100"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0 and "FLOPs" in plan.stdout, plan.stderr
    typo = subprocess.run([sys.executable, "-m", "lab", "trian"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "did you mean train?" in one_error_line(typo.stderr)
