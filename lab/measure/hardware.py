"""GPUs on paper: their dense peaks and memory from the vendors' data sheets, and the time a budget of FLOPs takes on
them. Pure arithmetic, as ``lab.measure.accounting``."""

from __future__ import annotations

from lab.measure.accounting import training_flops

# Dense (not 2:4 sparse) tensor-core peaks in FLOP/s, from the vendors' data sheets (SXM parts).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
}
GPU_MEMORY_BYTES: dict[str, float] = {"A100": 80e9, "H100": 80e9, "H200": 141e9}


def gpu_model(gpu: str) -> str:
    """The table key a GPU name refers to (case-insensitive; 'NVIDIA H100 80GB HBM3' gives 'H100')."""
    key = next((k for k in GPU_PEAK_FLOPS if k.lower() in gpu.lower()), None)
    if key is None:
        raise ValueError(f"unknown GPU '{gpu}' (known: {', '.join(GPU_PEAK_FLOPS)})")
    return key


def gpu_peak_flops(gpu: str, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of a GPU by name (case-insensitive; 'NVIDIA H100 80GB HBM3' works too)."""
    key = gpu_model(gpu)
    table = GPU_PEAK_FLOPS[key]
    if dtype not in table:
        raise ValueError(f"no {dtype} peak for {key} (known: {', '.join(table)})")
    return table[dtype]


def training_seconds(flops: float, gpu: str, n_gpus: int, mfu: float, dtype: str = "bf16") -> float:
    """Wall-clock seconds to spend ``flops`` on ``n_gpus`` at a model-FLOPs utilisation ``mfu``."""
    if n_gpus <= 0 or not 0 < mfu <= 1:
        raise ValueError("need n_gpus > 0 and 0 < mfu <= 1")
    return flops / (n_gpus * gpu_peak_flops(gpu, dtype) * mfu)


def duration(seconds: float) -> str:
    """A time as one short figure: seconds below two minutes, minutes below two hours, else hours ('95s',
    '7.5min', '3.2h')."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"


def gpu_memory_bytes(gpu: str) -> float:
    """Memory of one GPU in bytes (decimal: 80 GB = 80e9), by name as in ``gpu_peak_flops``."""
    return GPU_MEMORY_BYTES[gpu_model(gpu)]


def training_days(params: float, tokens: float, gpu: str, n_gpus: int, mfu: float, dtype: str = "bf16") -> float:
    """Wall-clock days to train ``params`` on ``tokens`` (C = 6·N·D) on ``n_gpus`` at ``mfu``."""
    return training_seconds(training_flops(params, tokens), gpu, n_gpus, mfu, dtype) / 86_400
