"""The throughput benchmark runs and reports sane figures (speed itself is not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.commands.bench import main, paired_ratio

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmark_script_runs_and_reports_mfu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["model"] for r in results} == {"tiny", "tiny-modern"}
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in results)
    assert "tiny-modern" in capsys.readouterr().out


@pytest.mark.slow
def test_a_throughput_case_runs_under_the_mixed_policy():
    """What ``make bench-gpu`` times under the bf16 policy (bf16 weights beside fp32 masters), here on the CPU."""
    import torch

    from lab.commands.bench import bench_case
    from lab.measure.device import Precision

    r = bench_case("tiny", 4096, 2, 1, 0, torch.device("cpu"), Precision("cpu", "bf16", mixed=True), compile=False)
    assert (r["dtype"], r["policy"]) == ("bf16", "mixed") and r["tokens_per_s"] > 0 and r["mem_peak_bytes"] > 0


def test_benchmark_rejects_bad_arguments(capsys):
    assert main(["--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.long
@pytest.mark.slow
def test_strategies_side_by_side_on_two_ranks(tmp_path):
    out = tmp_path / "parallel"
    labels = ["single", "ddp_naive", "ddp:bucket_mb=1", "torch_ddp", "deepspeed:zero_stage=2,offload=optimizer",
              "ddp_naive:pp=2,pp_microbatches=4"]
    proc = subprocess.run([sys.executable, "launch/bench.py", "--strategies", " ".join(labels),
                           "--nproc", "2", "--steps", "1", "--rounds", "1", "--warmup", "1", "--d-model", "64",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["label"] for r in rows] == labels
    for r in rows[1:4]:
        assert r["comm_bytes_per_step"] == r["comm_bytes_per_step_theory"] and r["tokens_per_s"] > 0
    # DeepSpeed's traffic is what its comms logger saw (it all-reduces where ZeRO-2's theory reduce-scatters)
    assert sum(rows[4]["comm_bytes_per_step"].values()) > 0 and rows[4]["tokens_per_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    table = out.with_suffix(".md").read_text()
    assert "| torch_ddp |" in table and "1.000×" in table
    ref = rows[3]["tokens_per_s"]
    for r in rows[:2]:  # the ratio is of tokens/s, as its header says (single runs half the tokens per step)
        ratio = r["tokens_per_s"] / ref  # one round: the paired ratio is the ratio of the medians
        assert f"| {r['label']} | {1e3 * r['step_time_s']:.1f} | {1e3 * r['cpu_time_s']:.1f} | " \
               f"{r['tokens_per_s']:,.0f} | {ratio:.3f}× [{ratio:.3f}, {ratio:.3f}] |" in table
        assert 0 < r["cpu_time_s"] < 10 * r["step_time_s"]  # rank 0's process: compute and gloo's threads
        row = next(line for line in table.splitlines() if line.startswith(f"| {r['label']} |"))
        assert r["minor_faults"] >= 0 and row.endswith(f"| {r['minor_faults']:,.0f} | - |")
    assert "round 1/1: ddp_naive" in proc.stdout  # progress while it runs
    piped = rows[5]  # two stages: the bubble and the activations in flight per stage, beside theory
    assert len(piped["pp_bubble"]) == 2 and piped["pp_in_flight_bytes"] == piped["pp_in_flight_bytes_theory"]
    held = "/".join(f"{b / 1e6:.2f}" for b in piped["pp_in_flight_bytes"])
    assert f"({100 * piped['pp_bubble_theory']:.0f}%) · {held} ({held}) |" in table


def test_paired_ratio_cancels_a_drift_that_unpaired_medians_do_not():
    # the machine slows down threefold during the run; the case is 5 % faster than the reference in every round
    reference = [100.0 / (1 + 0.1 * r) for r in range(21)]
    case = [1.05 * t for t in reference]
    assert paired_ratio(case, reference) == pytest.approx((1.05, 1.05, 1.05))
    # one disturbed round does not move the median
    noisy = case[:]
    noisy[3] *= 0.5
    assert paired_ratio(noisy, reference) == pytest.approx((1.05, 1.05, 1.05))
    # with half the rounds slower and half faster, the interval straddles both
    median, low, high = paired_ratio([0.9 * t if r % 2 else 1.1 * t for r, t in enumerate(reference)], reference)
    assert low == pytest.approx(0.9) and high == pytest.approx(1.1)


def test_strategies_with_a_bad_option_fail_before_starting_ranks(capsys):
    assert main(["--strategies", "ddp:bucket_mb=-1"]) == 2
    assert "parallel.bucket_mb must be positive" in capsys.readouterr().err


def test_memory_benchmark_rejects_an_unknown_strategy_before_any_run(capsys):
    assert main(["--memory", "ddp,zero9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "zero9" in err and len(err.strip().splitlines()) == 1


@pytest.mark.long
@pytest.mark.slow
def test_memory_benchmark_reports_the_kernels_rss_peak_bytes_and_loopback_bytes(tmp_path):
    out = tmp_path / "memory"
    small = "--model.n_layer 2 --model.d_model 64 --model.n_head 2"  # 5 steps, 4 of them timed
    assert main(["--memory", "ddp,zero3", "--nproc", "2", "--run-args", small, "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["ddp", "zero3"]
    for r in rows:
        assert r["rss_peak_bytes"] > r["peak_bytes"]["step"] > r["model_state_bytes"]["total"]
        assert set(r["peak_bytes_theory"]) == {"forward", "backward", "step"}
        # the counter read by rank 0 at the end of the first and the last step: every byte the formula counts
        # crossed the loopback interface inside that window, and little more (0.5-0.6 % framing and the loop's
        # scalars when measured; other processes' loopback traffic, at the rate seen before the run, on top)
        lo = r["loopback"]
        others = 3 * lo["background_bytes_per_s"] * lo["seconds"] / 4
        assert 0 < lo["formula_bytes_per_step"] <= lo["bytes_per_step"] <= 1.05 * lo["formula_bytes_per_step"] + others
    assert "| zero3 |" in out.with_suffix(".md").read_text()


def test_the_gpu_benchmark_says_in_one_line_that_it_needs_a_gpu(tmp_path, capsys, monkeypatch):
    from lab.commands import bench_gpu

    monkeypatch.setattr(bench_gpu.torch.cuda, "is_available", lambda: False)  # as on CI, whatever this machine has
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bench-gpu needs a CUDA GPU") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.long
@pytest.mark.slow
def test_the_gpu_benchmarks_strategy_runs_run_under_both_policies_on_the_cpu():
    """``make bench-gpu``'s ddp and zero3 runs under autocast and the bf16 policy, through the same code with the CPU
    in place of CUDA, a tiny model and 4 sequences of 128 tokens a step: every run's figures and both ratios."""
    from lab.commands import bench_gpu

    cpu = ["--train.device", "cpu", "--train.dtype", "bf16", "--model.n_layer", "1", "--model.d_model", "32",
           "--model.n_head", "2", "--model.block_size", "128", "--train.micro_batch", "4", "--train.batch_tokens",
           "512", "--train.tokens", str(3 * 512), "--train.eval_tokens", "512"]
    runs, ratios = bench_gpu.strategy_runs(cpu, "gloo")
    assert set(runs) == {"ddp autocast", "zero3 autocast", "ddp mixed", "zero3 mixed"} and set(ratios) == {
        "autocast", "mixed"}
    assert all(r > 0 for r in ratios.values())
    for name, run in runs.items():
        assert run["step_time_s"] > 0 and set(run["peak_bytes_theory"]) == {"forward", "backward", "step"}, name
    for strategy in bench_gpu.STRATEGIES:  # the policy's weights are 2 bytes a value, autocast's 4
        mixed, autocast = (runs[f"{strategy} {p}"]["model_state_bytes"] for p in ("mixed", "autocast"))
        assert mixed["params"] == autocast["params"] / 2, strategy


def test_the_gpu_benchmark_table_names_the_device_and_every_figure():
    from lab.commands.bench_gpu import markdown

    row = {"model": "gpt2-124m", "dtype": "bf16", "policy": "mixed", "compile": True, "tokens_per_s": 1e5, "mfu": 0.4,
           "mem_peak_bytes": 2**31}
    run = {"step_time_s": 0.1, "peak_bytes": {"forward": 3 * 2**20, "rss": 1}, "peak_bytes_theory": {"forward": 2**21}}
    text = markdown({"device": "NVIDIA H100", "torch": "2.13.0", "throughput": [row],
                     "runs": {"ddp mixed": run, "zero3 mixed": run},
                     "zero3_over_ddp_step_time": {"autocast": 1.2, "mixed": 1.1}})
    assert text.startswith("# GPU benchmark: NVIDIA H100")
    assert "| gpt2-124m | bf16 mixed | True | 100,000 | 40.0 % | 2.00 |" in text
    assert "| zero3 mixed | 100.0 | 3 vs 2 (+50%) |" in text
    assert "zero3 / ddp step time under mixed: 1.100x" in text and "under autocast: 1.200x" in text
