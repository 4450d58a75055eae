"""Peak memory per phase of a step, measured where the bytes are: tensor storages, the CUDA allocator, the kernel.

``Meter`` runs around a whole run (from before the strategy builds its model). On the CPU a
``TorchDispatchMode`` sees the output of every tensor operation; each new storage is counted
until it dies (a weak reference's callback) or is resized (``UntypedStorage.resize_`` is watched, and
``_swap_data_ptr_``, which moves memory between two storages),
so the live bytes and their peak follow what the allocator really holds, whoever keeps a storage
alive (autograd's saved tensors included). On CUDA the allocator's own peak is read and reset per
phase. Beside it, the kernel's peak resident set of the process (``VmHWM``, a high-water mark over
the whole run so far, never reset: an outside ``ru_maxrss`` reading must stay true).

The loop marks the phases (``phase("forward")``, ``"backward"``, ``"step"``) and takes the peaks
once per step (``take_step_peaks``); a strategy may ``tag`` a storage with a kind (``params``,
``grads``) so that the peak of each kind is known too. Both are no-ops when no meter runs.

``LiveBytes`` costs about 6 µs per operation: 9 % of a step of the 85M model in
benchmarks/memory/README.md, twice a tiny model's step; the loop runs it only under
``train.memory_meter`` (the RSS, and on CUDA the allocator, always). It counts tensor storages
made on the thread that runs the step: allocator slack, libraries and what the communication
backend allocates on its own threads show in the RSS alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import weakref
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from lab.runtime.compat import TorchDispatchMode, tree_leaves

PHASES = ("forward", "backward", "step")
# glibc: freed blocks at least this large go straight back to the kernel (M_MMAP_THRESHOLD, fixed so that the
# dynamic threshold does not climb to 32 MiB and keep freed gathered units resident in the heap)
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3


def return_freed_memory_to_kernel() -> bool:
    """Have glibc's malloc serve every block of ``MMAP_THRESHOLD`` or more with its own mapping, returned to the
    kernel when freed (as ``MALLOC_MMAP_THRESHOLD_`` would); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError, TypeError):
        return False


def proc_kib_field(path: str, key: str) -> int | None:
    """A ``KEY: N kB`` line of a /proc file (``/proc/self/status``, ``/proc/meminfo``) in bytes; None without it."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """The kernel's peak resident set of this process so far (VmHWM), in bytes; 0 where /proc is absent."""
    return proc_kib_field("/proc/self/status", "VmHWM") or 0


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now, by kind, and the peaks of the total per phase and of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, list] = {}  # id(storage) -> [weak reference, bytes, kind]
        self.current: defaultdict[str, int] = defaultdict(int)  # by kind, and "total"
        self.kind_peaks: defaultdict[str, int] = defaultdict(int)
        self.phase_peaks: dict[str, int] = {}
        self.at_phase_peaks: dict[str, dict[str, int]] = {}  # the bytes of each kind at each phase's peak
        self.phase: str | None = None
        self._resize = self._swap = None

    # ------------------------------------------------------------ what is alive

    def see(self, tensor: torch.Tensor, kind: str = "other") -> None:
        """Count ``tensor``'s storage if it is new (or follow a change of its size)."""
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        entry = self._storages.get(id(storage))
        if entry is None:
            key = id(storage)
            entry = [weakref.ref(storage, lambda _, key=key: self._gone(key)), 0, kind]
            self._storages[key] = entry
        self._resized(entry, storage.nbytes())

    def tag(self, tensor: torch.Tensor, kind: str) -> None:
        """Count ``tensor``'s storage under ``kind`` from now on."""
        self.see(tensor, kind)
        entry = self._storages.get(id(tensor.untyped_storage()))
        if entry is not None and entry[2] != kind:
            self.current[entry[2]] -= entry[1]
            entry[2] = kind
            self.current[kind] += entry[1]
            self.kind_peaks[kind] = max(self.kind_peaks[kind], self.current[kind])

    def _resized(self, entry: list, nbytes: int) -> None:
        change, entry[1] = nbytes - entry[1], nbytes
        if change == 0:
            return
        self.current[entry[2]] += change
        self.current["total"] += change
        if change > 0:
            self.kind_peaks[entry[2]] = max(self.kind_peaks[entry[2]], self.current[entry[2]])
            if self.phase is not None and self.current["total"] > self.phase_peaks[self.phase]:
                self.phase_peaks[self.phase] = self.current["total"]
                self.at_phase_peaks[self.phase] = dict(self.current)

    def _gone(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self.current[entry[2]] -= entry[1]
            self.current["total"] -= entry[1]

    # ------------------------------------------------------------ phases

    def enter_phase(self, name: str | None) -> None:
        self.phase = name
        if name is not None and self.current["total"] > self.phase_peaks.get(name, -1):
            self.phase_peaks[name] = self.current["total"]
            self.at_phase_peaks[name] = dict(self.current)

    def take_peaks(self) -> tuple[dict[str, int], dict[str, int]]:
        """(peak total per phase, peak per kind) since the last call; counting starts again from what is alive."""
        phases, kinds = self.phase_peaks, dict(self.kind_peaks)
        self.phase_peaks = {}
        self.kind_peaks = defaultdict(int, {k: v for k, v in self.current.items() if k != "total"})
        return phases, kinds

    # ------------------------------------------------------------ the mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor first turns into the plain tensors it holds, seen then
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) in (torch.Tensor, torch.nn.Parameter):  # not a fake tensor (sharding propagation)
                self.see(t)
        return out

    def _follow(self, *storages: torch.UntypedStorage) -> None:
        for storage in storages:
            entry = self._storages.get(id(storage))
            if entry is not None:
                self._resized(entry, storage.nbytes())

    def __enter__(self) -> LiveBytes:
        resize, swap = self._resize, self._swap = (torch.UntypedStorage.resize_,
                                                   getattr(torch.UntypedStorage, "_swap_data_ptr_", None))

        def resize_(storage: torch.UntypedStorage, size: int) -> None:  # not a dispatched operation
            resize(storage, size)
            self._follow(storage)

        def swap_data_ptr_(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:  # nor is this
            swap(storage, other)
            # the one that gave its memory away first: no peak that never was
            self._follow(*sorted((storage, other), key=lambda s: s.nbytes()))

        torch.UntypedStorage.resize_ = resize_
        if swap is not None:
            torch.UntypedStorage._swap_data_ptr_ = swap_data_ptr_
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        if self._swap is not None:
            torch.UntypedStorage._swap_data_ptr_ = self._swap
        super().__exit__(*exc)


class Meter:
    """Per-step peak bytes by phase: tensor storages on the CPU (``LiveBytes``, when ``track_tensors``), the allocator
    on CUDA, and the RSS."""

    def __init__(self, device: torch.device, track_tensors: bool = True):
        self.device = device
        self.live = LiveBytes() if device.type == "cpu" and track_tensors else None
        self._cuda_peaks: dict[str, int] = {}
        self.cuda_run_peak = 0  # the allocator's peak over the run, across the per-phase resets

    @contextlib.contextmanager
    def running(self) -> Iterator[Meter]:
        global _active
        before, _active = _active, self
        try:
            with self.live if self.live is not None else contextlib.nullcontext():
                yield self
        finally:
            _active = before

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.live is not None:
            self.live.enter_phase(name)
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            if self.live is not None:
                self.live.enter_phase(None)
            elif self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device)
                self._cuda_peaks[name] = max(self._cuda_peaks.get(name, 0), peak)
                self.cuda_run_peak = max(self.cuda_run_peak, peak)

    def take_step_peaks(self) -> dict[str, int]:
        """``{forward, backward, step, rss}`` since the last call (a phase not measured or not run: absent)."""
        if self.live is not None:
            peaks, _ = self.live.take_peaks()
        else:
            peaks, self._cuda_peaks = self._cuda_peaks, {}
        return {**{p: peaks[p] for p in PHASES if p in peaks}, "rss": peak_rss_bytes()}


_active: Meter | None = None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the step for the running meter (nothing when none runs)."""
    if _active is None:
        yield
        return
    with _active.phase(name):
        yield


def tag(tensor: torch.Tensor, kind: str) -> None:
    """Count ``tensor``'s storage under ``kind`` in the running meter (nothing when none runs or on CUDA)."""
    if _active is not None and _active.live is not None:
        _active.live.tag(tensor, kind)


def run_peak(allocator_peak: int) -> int:
    """``allocator_peak`` (the CUDA allocator's peak since its last reset, or a CPU's peak RSS), raised to the most
    any phase of the running meter reached on CUDA: the meter resets the allocator's peak every phase."""
    return max(allocator_peak, _active.cuda_run_peak if _active is not None else 0)


def take_step_peaks() -> dict[str, int]:
    """The running meter's ``{forward, backward, step, rss}`` since the last call (``{}`` when none runs)."""
    return _active.take_step_peaks() if _active is not None else {}
