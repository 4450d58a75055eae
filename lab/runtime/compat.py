"""Every private torch and DeepSpeed internal the lab uses, behind one door.

The lab is tested with the versions in ``TESTED``. What it reaches for that those libraries do not
promise to keep (a storage swapping its memory with another's, the autograd graph task's id, a device
mesh split into two axes, DeepSpeed's optimizer fields) is named here once; ``check`` looks each up and
fails in one line, naming the internal and the versions, when an installed version lacks it. The rest
of the lab calls the functions below, never the internals themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lab.runtime.config import ConfigError

TESTED = {"torch": "2.13", "deepspeed": "0.19"}
try:
    from torch.utils._pytree import tree_leaves
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # reported by check(), before any work
    tree_leaves, TorchDispatchMode = None, object


class Incompatible(ConfigError):
    """An installed library lacks an internal the lab uses."""


def _missing(package: str, internal: str) -> Incompatible:
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        installed = "(not installed)"
    return Incompatible(f"{package} {installed} has no {internal}, which the lab uses (tested with "
                        f"{package} {TESTED[package]}.x; install that version)")


def torch_internals() -> dict[str, bool]:
    """Each private torch internal the lab uses, and whether the installed torch has it."""
    return {"torch._C._current_graph_task_id": hasattr(torch._C, "_current_graph_task_id"),
            "DeviceMesh._unflatten": hasattr(DeviceMesh, "_unflatten"),
            "DeviceMesh._flatten": hasattr(DeviceMesh, "_flatten"),
            "torch.distributed.distributed_c10d._set_pg_timeout": hasattr(dist.distributed_c10d, "_set_pg_timeout"),
            "torch.utils._pytree.tree_leaves": tree_leaves is not None,
            "torch.utils._python_dispatch.TorchDispatchMode": TorchDispatchMode is not object}


def check() -> None:
    """Raise ``Incompatible`` (one line) when the installed torch lacks an internal the lab needs."""
    missing = [name for name, present in torch_internals().items() if not present]
    if missing:
        raise _missing("torch", missing[0])


# ---------------------------------------------------------------- torch

def in_backward() -> bool:
    """Whether this runs inside an autograd backward (a recomputation for activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


SWAPS_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # optional: without it zero3 allocates afresh


def swap_storage(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory behind two storages (views of either see the other's bytes)."""
    a._swap_data_ptr_(b)


def unflatten_mesh(mesh: Any, sizes: tuple[int, int], names: tuple[str, str]) -> Any:
    """A one-axis device mesh seen as two axes of ``sizes`` (known to DTensor as the original axis flattened,
    so a reduction over both is one collective over the group)."""
    two = mesh._unflatten(0, sizes, names)
    two._flatten()
    return two


def ddp_without_buffer_sync() -> dict[str, bool]:
    """DistributedDataParallel's keyword that turns off the buffers' broadcast before each forward: torch 2.13
    renamed ``broadcast_buffers`` to ``forward_sync_buffers`` and deprecated the old name."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def ddp_expect_backward(ddp: DistributedDataParallel) -> None:
    """Ready DDP's reducer for a backward whose forward bypassed ``DistributedDataParallel.forward`` (what its
    forward does when gradients sync and no unused parameter is searched for; torch.distributed.pipelining does the
    same for a DDP-wrapped stage)."""
    ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward([])


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """Leave the parameters ``names`` of ``module`` out of the DistributedDataParallel built around it next (neither
    broadcast nor all-reduced by it)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def inherit_timeout(group: dist.ProcessGroup) -> None:
    """Give a new group the default group's timeout: torch gives each new group its own default (30 min for gloo,
    10 for NCCL)."""
    device = group._device_types[0]
    timeout = dist.group.WORLD._get_backend(device).options._timeout
    dist.distributed_c10d._set_pg_timeout(timeout, group)


# ---------------------------------------------------------------- DeepSpeed

def deepspeed_fragment(param: torch.nn.Parameter) -> Any | None:
    """ZeRO-1/2's mapping from a parameter to its fragment of this rank's fp32 master partition (None: none here)."""
    if not hasattr(param, "_hp_mapping"):
        raise _missing("deepspeed", "Parameter._hp_mapping")
    return param._hp_mapping


@contextmanager
def deepspeed_fp32_groups(optimizer: Any) -> Iterator[None]:
    """ZeRO-3's fp32 partitions set as the inner optimizer's parameter groups for the duration."""
    for name in ("_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups"):
        if not hasattr(optimizer, name):
            raise _missing("deepspeed", f"DeepSpeedZeroOptimizer_Stage3.{name}")
    optimizer._set_fp32_optimizer_param_groups()
    try:
        yield
    finally:
        optimizer._clear_fp32_optimizer_param_groups()


# the engine's optimizer fields and methods the lab reads, by ZeRO stage (stages 1 and 2 share one optimizer class)
DEEPSPEED_OPTIMIZER_FIELDS = {
    1: ("single_partition_of_fp32_groups", "bit16_groups_flat", "averaged_gradients", "scaled_global_norm",
        "update_lp_params"),
    3: ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "grad_position", "get_param_id",
        "averaged_gradients", "_get_norm_groups", "_reassign_or_swap_out_partitioned_parameters"),
}


def check_deepspeed_optimizer(optimizer: Any, stage: int) -> None:
    """Raise ``Incompatible`` (one line, naming the first) when the engine's ZeRO optimizer lacks a field the lab
    reads (``DEEPSPEED_OPTIMIZER_FIELDS``): checked once the engine is built, before any step."""
    for name in DEEPSPEED_OPTIMIZER_FIELDS[3 if stage == 3 else 1]:
        if not hasattr(optimizer, name):
            raise _missing("deepspeed", f"{type(optimizer).__name__}.{name}")
