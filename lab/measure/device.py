"""Where a run computes and how fast that hardware could go: one place for the loop and the benchmark.

- ``resolve_device``: cuda (this process's local rank) or cpu;
- ``Precision``: the run's precision policy (``train.dtype``, ``train.precision``, ``train.reduce_dtype``): fp32;
  16-bit autocast over fp32 weights (the default on CUDA); or mixed precision as ZeRO and FSDP run it (weights,
  gradients and their collectives in 16 bits, fp32 master weights and moments in the optimizer); fp16 scales the
  loss (``lab.parallel.precision.LossScaler``);
- ``peak_flops``: the dense data-sheet peak on a GPU (``lab.measure.hardware``), or on a CPU a matmul
  peak measured once per machine, thread count, torch version and dtype, within a time budget and
  with a private random generator (the training RNG is never touched), then cached in
  ``$XDG_CACHE_HOME/scaling-lab/cpu-peaks.json`` with the time and load average of the measurement.
  One figure is the denominator of every run's MFU on that machine, so runs compare: it is cached even when
  the machine was busy (load above its cores: the figure reads low, and a run starts with a warning), processes
  that start together measure it once (a lock), and a run measures again only when its MFU exceeds 100 %
  (the figure is then provably low); ``python -m lab peak --remeasure`` measures again on demand; the best
  figure seen is kept;
- memory: the peak this process used, and what is available before a run starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import platform
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.measure import hardware
from lab.runtime.config import ConfigError, Parser, did_you_mean, print_error
from lab.runtime.files import write_atomic
from lab.measure.memory import proc_kib_field, return_freed_memory_to_kernel

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16", "fp16")
POLICIES = ("autocast", "mixed")
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp16")
PEAK_BUDGET_S = 1.5  # measuring a CPU peak stops before this much time has gone
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``cuda`` (device ``local_rank``) when asked for or, with ``auto``, when there is one; else the CPU."""
    if name not in DEVICES:
        raise ConfigError(f"train.device must be auto, cpu or cuda, got '{name}'{did_you_mean(name, DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no CUDA device is available")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_device(device: torch.device) -> None:
    """Select the CUDA device and allow TF32 matmuls on it; on the CPU, have glibc return freed tensors to the
    kernel (``lab.measure.memory.return_freed_memory_to_kernel``), so that the resident set follows what is alive."""
    if device.type == "cpu":
        return_freed_memory_to_kernel()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass(frozen=True)
class Precision:
    """A run's precision policy.

    ``dtype`` is what the matmuls compute in (fp32, bf16 or fp16). ``mixed`` False (``train.precision autocast``):
    fp32 weights, gradients, optimizer states and collectives, a 16-bit ``dtype`` only inside autocast around the
    forward. ``mixed`` True (``train.precision mixed``, as ZeRO, FSDP2's ``MixedPrecisionPolicy`` and DeepSpeed's
    bf16/fp16 optimizers train): the weights the forward and backward compute with (``param_dtype``) and their
    gradients are 16-bit, the gradient collectives run in ``reduce_dtype`` (by default the weights' dtype), and the
    optimizer updates fp32 master weights with fp32 moments, from which the weights are cast after each step. fp16
    (either way) scales the loss dynamically: ``loss_scale`` to start, halved at a non-finite gradient (the step
    skipped), doubled after ``loss_scale_window`` clean steps.
    """

    device_type: str
    dtype: str = "fp32"
    mixed: bool = False
    reduce: str | None = None  # the gradient collectives' dtype (None: the weights')
    loss_scale: float = 2.0**16
    loss_scale_window: int = 1000

    @property
    def compute_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def param_dtype(self) -> torch.dtype:
        """The weights' dtype as the forward and backward use them (and the hidden state's between blocks)."""
        return self.compute_dtype if self.mixed else torch.float32

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in."""
        return _TORCH_DTYPES[self.reduce] if self.reduce else self.param_dtype

    @property
    def autocasts(self) -> bool:
        """16-bit autocast around fp32 weights (which keeps 16-bit copies of them for the forward and backward)."""
        return self.dtype != "fp32" and not self.mixed

    @property
    def scales_loss(self) -> bool:
        return self.dtype == "fp16"

    @property
    def state_widths(self) -> str:
        """The ``lab.measure.accounting.model_state_bytes`` precision of a strategy that keeps the ZeRO layout."""
        return "mixed" if self.mixed else "fp32"

    @property
    def name(self) -> str:
        """The policy in a few words (the summary's)."""
        if self.dtype == "fp32":
            return "fp32"
        if not self.mixed:
            return f"{self.dtype} autocast"
        reduce = _DTYPE_NAMES[self.reduce_dtype]
        return f"{self.dtype} mixed ({self.dtype} weights and gradients, {reduce} reduce, fp32 master weights and " \
               f"moments)"

    @property
    def short(self) -> str:
        """The policy in a few words (the start line's): the dtype, autocast or mixed, a reduce dtype of its own."""
        if self.dtype == "fp32":
            return "fp32"
        reduce = f", {self.reduce} reduce" if self.reduce and self.reduce != self.dtype else ""
        return f"{self.dtype} {'mixed' if self.mixed else 'autocast'}{reduce}"

    @property
    def activation_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype around fp32 weights (none where the weights are in it already)."""
        if self.autocasts:
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()


def resolve_precision(dtype: str, device: torch.device, policy: str = "autocast", reduce_dtype: str = "auto",
                      loss_scale: float = 2.0**16, loss_scale_window: int = 1000) -> Precision:
    """The policy the ``train`` options name on ``device``; ``auto`` dtype means bf16 on CUDA and fp32 on the CPU.
    ConfigError (one line) for a combination that cannot run."""
    for option, value, allowed in (("dtype", dtype, DTYPES), ("precision", policy, POLICIES),
                                   ("reduce_dtype", reduce_dtype, REDUCE_DTYPES)):
        if value not in allowed:
            raise ConfigError(f"train.{option} must be one of {', '.join(allowed)}, got '{value}'"
                              f"{did_you_mean(value, allowed)}")
    if dtype == "auto":
        dtype = "bf16" if device.type == "cuda" else "fp32"
    if policy == "mixed" and dtype == "fp32":
        raise ConfigError("train.precision mixed keeps 16-bit weights beside fp32 masters: set train.dtype bf16 or "
                          "fp16")
    if reduce_dtype != "auto" and policy != "mixed" and reduce_dtype != "fp32":
        raise ConfigError(f"train.reduce_dtype {reduce_dtype} needs train.precision mixed (under {policy} the "
                          f"gradients are fp32)")
    if dtype == "fp16" and not (loss_scale > 0 and loss_scale_window >= 1):
        raise ConfigError(f"fp16 needs train.loss_scale > 0 and train.loss_scale_window >= 1, got {loss_scale} and "
                          f"{loss_scale_window}")
    return Precision(device.type, dtype, policy == "mixed", None if reduce_dtype == "auto" else reduce_dtype,
                     loss_scale, loss_scale_window)


def precision_of(train: object, device: torch.device) -> Precision:
    """The policy of a run's ``train`` section (``lab.runtime.config.TrainConfig``) on ``device``."""
    return resolve_precision(train.dtype, device, train.precision, train.reduce_dtype, train.loss_scale,
                             train.loss_scale_window)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a SLURM or taskset allotment)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def size_threads(processes: int) -> int:
    """Give this process its share of the usable cores as torch's intra-op threads (``processes`` of one job share
    this machine), unless OMP_NUM_THREADS says how many; returns the count. More threads than cores make each
    process's OpenMP threads wait on the others' (measured in benchmarks/threads/README.md)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() // max(1, processes)))
    return torch.get_num_threads()


def threads(count: int | None = None) -> str:
    """``1 thread`` or ``N threads``: ``count``, by default torch's intra-op threads."""
    count = torch.get_num_threads() if count is None else count
    return f"{count} thread{'' if count == 1 else 's'}"


def describe(device: torch.device) -> str:
    """The device in words: the GPU's name, or the CPU's model and thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {threads()}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- peaks


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of one device
    source: str  # where the figure comes from, in full (the summary's)
    measured: torch.dtype | None = None  # the dtype of a CPU measurement (None: a data sheet or train.peak_flops)
    record: PeakRecord | None = None  # the cached CPU measurement

    @property
    def label(self) -> str:
        """The source in a few words (the start line's and the warnings')."""
        return self.source if self.measured is None else f"measured {_DTYPE_NAMES[self.measured]}"


def peak_flops(device: torch.device, precision: Precision, override: float = 0.0) -> Peak:
    """The MFU denominator for one device: ``override`` when positive, else the GPU table or the CPU measurement
    (``cpu_matmul_peak``)."""
    if override > 0:
        return Peak(override, "train.peak_flops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = "tf32" if precision.dtype == "fp32" else precision.dtype
        return Peak(hardware.gpu_peak_flops(name, kind), f"data sheet: {name}, dense {kind}")
    return cpu_matmul_peak(precision.compute_dtype)


def cpu_matmul_peak(dtype: torch.dtype) -> Peak:
    """The peak of this CPU's matmuls in ``dtype``: its measured figure, or the fp32 one where that is higher. A CPU
    without 16-bit units computes 16-bit matmuls no faster than fp32 ones, so its fp32 peak bounds them (issue 61
    saw a run's bf16 matmuls outpace the bf16 benchmark there)."""
    peak = cpu_peak_flops(dtype)
    if dtype == torch.float32:
        return peak
    fp32 = cpu_peak_flops(torch.float32)
    return fp32 if fp32.flops > peak.flops else peak


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "scaling-lab" / "cpu-peaks.json"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _peak_key(dtype: torch.dtype) -> str:
    return f"{cpu_name()} | {torch.get_num_threads()} threads | torch {torch.__version__} | {dtype}"


@dataclass(frozen=True)
class PeakRecord:
    """One CPU matmul peak measurement: its FLOP/s, when it was taken, under what load and on how many threads."""

    flops: float
    measured_at: str  # UTC
    load: float | None  # the 1-minute load average just before (other work competing for the cores)
    threads: int | None = None  # torch's intra-op threads (None: written before they were recorded)

    @property
    def load_text(self) -> str:
        return "load unknown" if self.load is None else f"load {self.load:.2f} on {os.cpu_count()} cores"

    def describe(self) -> str:
        return (f"{threads(self.threads)}, " if self.threads else "") + f"{self.measured_at}, {self.load_text}"

    @property
    def caveat(self) -> str:
        """What follows its description when it was taken on a busy machine."""
        return "; busy then: reads low, so MFU reads high" if self.busy else ""

    @property
    def busy(self) -> bool:
        """Whether the machine was busy when it was taken (load above its cores): such a figure reads low."""
        return self.load is not None and self.load > (os.cpu_count() or 1)


def _read_cache() -> dict[str, PeakRecord]:
    try:
        cache = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    records = {}
    for key, value in cache.items() if isinstance(cache, dict) else ():
        if isinstance(value, (int, float)):  # written before the time and load were recorded
            value = {"flops": value}
        if isinstance(value, dict) and isinstance(value.get("flops"), (int, float)) and value["flops"] > 0:
            load, threads = value.get("load"), value.get("threads")
            records[key] = PeakRecord(float(value["flops"]), str(value.get("measured_at", "at an unknown time")),
                                      float(load) if isinstance(load, (int, float)) else None,
                                      threads if isinstance(threads, int) else None)
    return records


def cpu_peak_flops(dtype: torch.dtype) -> Peak:
    """This CPU's matmul FLOP/s in ``dtype``: the cached figure, or one measured now (< 2 s) and cached. Processes
    that find none at once take turns (a lock beside the cache): the first measures, the others read its figure."""
    with _measuring():
        cached = _read_cache().get(_peak_key(dtype))
        return _measured_peak(dtype, cached if cached else record_cpu_peak(dtype)[1])


@contextlib.contextmanager
def _measuring():
    """Hold the lock beside the cache (blocking) while the cache is read and, if needed, a peak measured: two
    processes measuring at once would each read the other's load. Without a writable cache folder, or on a file system
    that refuses flock (some Lustre and FUSE mounts), no lock: the turns are only a courtesy."""
    try:
        _cache_file().parent.mkdir(parents=True, exist_ok=True)
        lock = open(_cache_file().with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _measured_peak(dtype: torch.dtype, record: PeakRecord) -> Peak:
    remeasure = "; python -m lab peak --remeasure on a quiet machine" if record.busy else ""
    return Peak(record.flops, f"measured matmul peak ({record.describe()}{record.caveat}{remeasure}; cached in "
                              f"{_cache_file()})", dtype, record)


def peak_warnings(peak: Peak, precision: Precision) -> list[str]:
    """The ``warning:`` lines a run starts with about its peak: measured on a busy machine (it reads low, MFU high);
    a 16-bit policy on a CPU whose 16-bit matmuls are slower than fp32 ones (``slow_16bit_warning``)."""
    lines = []
    if peak.record is not None and peak.record.busy:
        lines.append(f"warning: the {peak.label} peak was taken under {peak.record.load_text}: it reads low and MFU "
                     f"high; measure again on a quiet machine with python -m lab peak --remeasure")
    if peak.measured is not None and precision.dtype != "fp32":
        lines.append(slow_16bit_warning(cpu_peak_flops(precision.compute_dtype)))
    return [line for line in lines if line]


def slow_16bit_warning(peak: Peak) -> str | None:
    """A ``warning:`` line when ``peak``, this CPU's measured matmul peak in a 16-bit dtype, is below its fp32 peak:
    the 16-bit policy then saves memory and bytes sent, not time. None for fp32, a GPU or a given peak."""
    if peak.measured not in (torch.bfloat16, torch.float16):
        return None
    fp32 = cpu_peak_flops(torch.float32).flops
    if peak.flops >= fp32:
        return None
    name = _DTYPE_NAMES[peak.measured]
    return (f"warning: this CPU's {name} matmul peak ({peak.flops:.3g} FLOP/s) is below its fp32 peak ({fp32:.3g}): "
            f"{name} saves memory and bytes sent here, not time (--train.dtype fp32 runs faster)")


def remeasure_low_peak(peak: Peak) -> Peak | None:
    """A CPU peak measured again now, when the figure ``peak`` holds reads lower than this one (a run's MFU above
    100 % says it does); else None. The best figure is cached, as in ``record_cpu_peak``."""
    if peak.measured is None:
        return None
    with _measuring():
        best = record_cpu_peak(peak.measured)[1]
    return _measured_peak(peak.measured, best) if best.flops > peak.flops else None


def record_cpu_peak(dtype: torch.dtype, budget_s: float = PEAK_BUDGET_S) -> tuple[PeakRecord, PeakRecord]:
    """Measure again and cache the best figure this machine has shown, with its time, load and threads (a
    measurement taken while other work competed for the cores reads low, and a later, higher one replaces it).
    Returns (this measurement, the best)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    now = PeakRecord(measure_matmul_peak(dtype, budget_s), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                     load, torch.get_num_threads())
    cache, key = _read_cache(), _peak_key(dtype)
    best = cache[key] if key in cache and cache[key].flops >= now.flops else now
    with contextlib.suppress(OSError):  # an unwritable cache only costs a measurement next time
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({k: dataclasses.asdict(r) for k, r in {**cache, key: best}.items()}, indent=1))
    return now, best


def remeasure_cpu_peak(dtype: torch.dtype, budget_s: float = PEAK_BUDGET_S) -> float:
    """``record_cpu_peak``'s best figure."""
    return record_cpu_peak(dtype, budget_s)[1].flops


def peak_main(argv: list[str] | None = None, prog: str = "python -m lab peak") -> int:
    """Show this CPU's cached matmul peaks (the MFU denominators of CPU runs), or measure them again."""
    p = Parser(prog=prog, description="This CPU's matmul peaks, the MFU denominators of CPU runs: "
                                                      "the best figure measured, with when and under what load.")
    p.add_argument("--remeasure", action="store_true", help="measure fp32 and bf16 again (do it on a quiet machine); "
                                                            "the cache keeps the best figure seen")
    p.add_argument("--budget", type=float, default=10.0, help="seconds per dtype for --remeasure")
    args = p.parse_args(argv)
    if not args.budget > 0:
        print_error(f"--budget must be positive, got {args.budget}")
        return 2
    print(f"{cpu_name()}, {threads()}, torch {torch.__version__}; cache {_cache_file()}")
    cache = _read_cache()
    for dtype in (torch.float32, torch.bfloat16):
        name = _DTYPE_NAMES[dtype]
        if args.remeasure:
            with _measuring():
                now, best = record_cpu_peak(dtype, args.budget)
            print(f"{name}: {now.flops / 1e9:,.1f} GFLOP/s now ({now.describe()}); kept {best.flops / 1e9:,.1f} "
                  f"GFLOP/s (measured {best.describe()})")
        elif (kept := cache.get(_peak_key(dtype))) is not None:
            print(f"{name}: {kept.flops / 1e9:,.1f} GFLOP/s (measured {kept.describe()}{kept.caveat})")
        else:
            print(f"{name}: not measured yet (the first CPU run measures it, or pass --remeasure)")
    return 0


def measure_matmul_peak(dtype: torch.dtype, budget_s: float = PEAK_BUDGET_S) -> float:
    """Best FLOP/s of square matmuls: the size grows from 256 to at most 2048 while the next one's
    predicted cost (8× the last matmul, four runs) fits in ``budget_s``; the time left is spent
    repeating the largest size, keeping the fastest run.

    Operands come from a private generator, so the global RNG (dropout, anything seeded by the
    run) is untouched. The figure is only as good as the machine is quiet.
    """
    generator = torch.Generator().manual_seed(0)
    started, best, n = time.perf_counter(), 0.0, 256
    while True:
        a = torch.randn(n, n, generator=generator).to(dtype)
        b = torch.randn(n, n, generator=generator).to(dtype)
        a @ b
        last = min(_timed(lambda: a @ b) for _ in range(3))
        best = max(best, 2 * n**3 / last)
        if n < 2048 and time.perf_counter() - started + 4 * 8 * last <= budget_s:
            n *= 2
            continue
        while time.perf_counter() - started + last <= budget_s:
            best = max(best, 2 * n**3 / _timed(lambda: a @ b))
        return best


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- memory


def peak_memory_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak, or this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of the GPU, or the host's available memory (shared by every process on it)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = proc_kib_field("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
