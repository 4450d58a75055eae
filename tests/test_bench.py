"""The throughput benchmark runs and reports sane figures (speed itself is not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

from lab.bench import main

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_script_runs_and_reports_mfu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["model"] for r in results} == {"tiny", "tiny-modern"}
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in results)
    assert "tiny-modern" in capsys.readouterr().out


def test_benchmark_rejects_bad_arguments(capsys):
    assert main(["--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_strategies_side_by_side_on_two_ranks(tmp_path):
    out = tmp_path / "parallel"
    labels = ["single", "ddp_naive", "ddp:bucket_mb=1", "torch_ddp", "deepspeed:zero_stage=2,offload=optimizer"]
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
        assert f"| {r['label']} | {1e3 * r['step_time_s']:.1f} | {r['tokens_per_s']:,.0f} | " \
               f"{r['tokens_per_s'] / ref:.3f}× |" in table
    assert "round 1/1: ddp_naive" in proc.stdout  # progress while it runs


def test_strategies_with_a_bad_option_fail_before_starting_ranks(capsys):
    assert main(["--strategies", "ddp:bucket_mb=-1"]) == 2
    assert "parallel.bucket_mb must be positive" in capsys.readouterr().err
