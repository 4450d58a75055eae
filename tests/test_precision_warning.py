"""A 16-bit policy on a CPU whose 16-bit matmuls are slower than its fp32 ones says so in one short line, and its MFU
is against the fp32 peak; the warnings about a peak are one short line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.measure import device
from lab.commands.cli import run_main
from lab.measure.device import Peak, slow_16bit_warning
from lab.parallel import World
from lab.runtime.config import RunConfig
from lab.training.admission import Estimate
from lab.training.plan import plan_run
from lab.training.runlog import checked_peak, start_line
from lab.training.steps import Start


def test_a_16bit_peak_below_the_fp32_peak_gives_one_short_warning(monkeypatch):
    monkeypatch.setattr(device, "cpu_peak_flops", lambda dtype: Peak(7.15e10, "measured", dtype))
    line = slow_16bit_warning(Peak(1.24e9, "measured", torch.bfloat16))
    assert line.startswith("warning: this CPU's bf16 matmul peak (1.24e+09 FLOP/s) is below its fp32 peak "
                           "(7.15e+10): bf16 saves memory and bytes sent here, not time")
    assert "\n" not in line and len(line) < 200
    assert "fp16 matmul peak" in slow_16bit_warning(Peak(1e9, "measured", torch.float16))


def test_no_warning_where_16_bits_are_as_fast_or_nothing_was_measured(monkeypatch):
    monkeypatch.setattr(device, "cpu_peak_flops", lambda dtype: Peak(7.15e10, "measured", dtype))
    assert slow_16bit_warning(Peak(1.5e11, "measured", torch.bfloat16)) is None  # a CPU with bf16 units
    assert slow_16bit_warning(Peak(7e10, "measured", torch.float32)) is None
    assert slow_16bit_warning(Peak(1e9, "train.peak_flops")) is None  # a given peak: nothing measured to compare


# ---------------------------------------------------------------- MFU against the peak the matmuls can reach


def _peaks(monkeypatch, tmp_path, fp32: float, bf16: float, load: float = 0.0) -> None:
    """A CPU whose matmul benchmark gives ``fp32`` and ``bf16`` FLOP/s, under ``load``, with an empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(device, "measure_matmul_peak",
                        lambda dtype, budget_s=0: fp32 if dtype == torch.float32 else bf16)
    monkeypatch.setattr(device.os, "getloadavg", lambda: (load, 0.0, 0.0))


def test_a_16bit_run_on_a_cpu_without_16bit_units_has_its_mfu_against_the_fp32_peak(monkeypatch, tmp_path):
    _peaks(monkeypatch, tmp_path, fp32=7.15e10, bf16=1.24e9)  # the CPU: its bf16 matmuls run 58x slower
    mixed = device.Precision("cpu", "bf16", mixed=True)
    peak = device.peak_flops(torch.device("cpu"), mixed)
    assert peak.flops == 7.15e10 and peak.measured == torch.float32 and peak.label == "measured fp32"
    warnings = device.peak_warnings(peak, mixed)
    assert len(warnings) == 1 and warnings[0].startswith("warning: this CPU's bf16 matmul peak (1.24e+09 FLOP/s)")


def test_a_cpu_with_16bit_units_keeps_its_16bit_peak(monkeypatch, tmp_path):
    _peaks(monkeypatch, tmp_path, fp32=7.15e10, bf16=1.5e11)
    autocast = device.Precision("cpu", "bf16")
    peak = device.peak_flops(torch.device("cpu"), autocast)
    assert (peak.flops, peak.measured) == (1.5e11, torch.bfloat16) and device.peak_warnings(peak, autocast) == []


class _Said:
    """A run log that keeps what it says."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        self.lines.extend(text.splitlines())


@pytest.mark.parametrize("load", [0.0, 50.0])  # the peak taken on a quiet and on a busy machine
def test_an_mfu_above_100_percent_that_a_new_measurement_does_not_explain_is_not_blamed_on_the_load(
        monkeypatch, tmp_path, load):
    _peaks(monkeypatch, tmp_path, fp32=7.15e10, bf16=1.24e9, load=load)
    peak, said = device.cpu_peak_flops(torch.bfloat16), _Said()
    assert checked_peak(peak, World(0, 1, 0, torch.device("cpu")), said) == peak  # measured again: the same figure
    assert len(said.lines) == 1 and said.lines[0].startswith(
        "warning: MFU above 100%: the peak (1.24e+09 FLOP/s, measured bf16) reads low (measured again, no higher: "
        "not the load")
    assert "other work" not in said.lines[0] and "busy" not in said.lines[0] and len(said.lines[0]) <= 200


def test_a_peak_that_read_low_and_measured_again_higher_says_so_in_one_warning(monkeypatch, tmp_path):
    long_cache = tmp_path / ("a-long-folder-name-" * 10)
    _peaks(monkeypatch, long_cache, fp32=1e9, bf16=1e9, load=50.0)
    peak, said = device.cpu_peak_flops(torch.float32), _Said()
    monkeypatch.setattr(device, "measure_matmul_peak", lambda dtype, budget_s=0: 7e10)  # the machine quiet again
    assert checked_peak(peak, World(0, 1, 0, torch.device("cpu")), said).flops == 7e10
    assert said.lines == ["warning: MFU above 100%: the peak (1e+09 FLOP/s, measured fp32) read low; measured "
                          "again: 7e+10 FLOP/s, used from here on"]


def test_a_busy_machines_peak_gives_a_short_warning_and_the_start_line_stays_short(monkeypatch, tmp_path):
    long_cache = tmp_path / ("a-long-folder-name-" * 10)
    _peaks(monkeypatch, long_cache, fp32=2e9, bf16=3e9, load=50.0)
    peak = device.cpu_peak_flops(torch.float32)
    cfg, world = RunConfig(), World(0, 1, 0, torch.device("cpu"))
    cfg.model.vocab_size = 512
    line = start_line(cfg, world, plan_run(cfg, 1).steps, device.Precision("cpu"), peak, Start(),
                      Estimate(0, 0, 60.0), "single")
    assert len(line) <= 170 and "peak 2e+09 FLOP/s (measured fp32) | about 60s at 30% MFU" in line  # about 160
    warnings = device.peak_warnings(peak, device.Precision("cpu"))
    assert len(warnings) == 1 and warnings[0].startswith("warning: the measured fp32 peak was taken under load 50.00")
    assert "a-long-folder-name" not in line + warnings[0] and len(warnings[0]) <= 200
    assert "a-long-folder-name" in peak.source  # the summary's account keeps the cache's path


@pytest.mark.slow  # trains a run
def test_the_first_step_of_a_mixed_run_without_bf16_units_has_the_warning_and_mfu_at_most_100_percent(
        args, monkeypatch, tmp_path, capsys):
    _peaks(monkeypatch, tmp_path / "cache", fp32=1e13, bf16=1e6)  # fast fp32 units, a bf16 benchmark far below
    mixed = ["--strategy", "zero3", "--train.precision", "mixed", "--train.dtype", "bf16"]
    assert run_main([*args, *mixed, "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("step "))
    assert out[first - 1].startswith("warning: this CPU's bf16 matmul peak (1e+06 FLOP/s) is below its fp32 peak")
    assert float(out[first].split(" | mfu ")[1].split("%")[0]) <= 100
    assert not any("MFU above 100%" in line for line in out)


@pytest.mark.slow  # trains a run in a subprocess
def test_no_line_a_run_starts_with_or_warns_in_is_over_200_characters(args, tmp_path):
    """A run whose cached fp32 peak was taken on a busy machine and reads low (MFU above 100 %, measured again),
    under bf16 whose peak is lower still, with the cache down a long path: every warning it can start with."""
    cache = tmp_path / ("a-long-folder-name-" * 10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the key the run's single thread reads (OMP_NUM_THREADS=1)
    try:
        keys = {dtype: device._peak_key(dtype) for dtype in (torch.float32, torch.bfloat16)}
    finally:
        torch.set_num_threads(threads)
    (cache / "scaling-lab").mkdir(parents=True)
    (cache / "scaling-lab" / "cpu-peaks.json").write_text(json.dumps({
        keys[torch.float32]: {"flops": 1e6, "measured_at": "then", "load": 99.0, "threads": 1},
        keys[torch.bfloat16]: {"flops": 5e5, "measured_at": "then", "load": 0.0, "threads": 1}}))
    proc = subprocess.run([sys.executable, "-m", "lab", "train", *args, "--train.dtype", "bf16", "--run-dir",
                           str(tmp_path / "r")], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.splitlines()
    start = out[:next(i for i, line in enumerate(out) if line.startswith("step "))] + proc.stderr.splitlines()
    warnings = [line for line in out + proc.stderr.splitlines() if "warning" in line.lower()]
    assert max(map(len, start + warnings)) <= 200, max(start + warnings, key=len)
    assert start[0].startswith("model: ") and all(line.startswith("warning: ") for line in warnings)
    for begins in ("warning: the measured fp32 peak was taken under load 99.00", "warning: this CPU's bf16 matmul",
                   "warning: MFU above 100%: the peak (1e+06 FLOP/s, measured fp32) read low; measured again: "):
        assert sum(line.startswith(begins) for line in warnings) == 1, begins


def test_lab_peak_gives_what_left_the_start_line_the_cache_and_a_busy_peaks_caveat(monkeypatch, tmp_path, capsys):
    _peaks(monkeypatch, tmp_path, fp32=2e9, bf16=3e9, load=50.0)
    device.cpu_peak_flops(torch.float32)
    assert device.peak_main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"; cache {tmp_path / 'scaling-lab' / 'cpu-peaks.json'}")
    assert out[1].startswith("fp32: 2.0 GFLOP/s (measured ")
    assert out[1].endswith("; busy then: reads low, so MFU reads high)")
