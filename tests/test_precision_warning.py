"""A 16-bit policy on a CPU whose 16-bit matmuls are slower than its fp32 ones says so in one short line."""

from __future__ import annotations

import torch

from lab.measure import device
from lab.measure.device import Peak, slow_16bit_warning


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
