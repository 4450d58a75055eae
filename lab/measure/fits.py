"""What fits on paper: the largest model whose states fit a GPU's memory under a ZeRO stage, and the deepest model of a
given width whose states and activations do. Pure arithmetic over ``lab.measure.accounting``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab.measure.accounting import ModelShape, activation_bytes, model_state_bytes, param_counts


def largest_model(memory_bytes: float, n_devices: int, strategy: str, precision: str = "mixed",
                  usable: float = 1.0, offload: bool = False, one_moment: float = 0.0) -> int:
    """The most parameters whose model states fit ``usable``·``memory_bytes`` on each of ``n_devices`` GPUs.

    States only (``model_state_bytes``), no activations. ``usable`` defaults to 1.0: the whole memory,
    with no headroom for the CUDA context, buffers or fragmentation (0.9 is a more honest planning
    figure). With ``offload`` only the GPU side limits; host memory is assumed sufficient. ``one_moment``: the share
    of the parameters whose optimizer keeps one moment (Muon's matrices).
    """
    if memory_bytes <= 0 or not 0 < usable <= 1:
        raise ValueError("need memory_bytes > 0 and 0 < usable <= 1")
    per_param = model_state_bytes(1.0, strategy, n_devices, precision, offload, one_moment).gpu
    return math.floor(usable * memory_bytes / per_param)


@dataclass(frozen=True)
class DepthFit:
    """The deepest model at a given width that fits, its parameters, and its per-GPU bytes."""

    n_layer: int
    params: int
    gpu_bytes: float  # model states + activations on one GPU


def largest_depth(shape: ModelShape, micro_batch: int, memory_bytes: float, n_devices: int, strategy: str,
                  precision: str = "mixed", usable: float = 1.0, offload: bool = False, bytes_per_act: int = 2,
                  checkpointing: bool = False, flash: bool = True, one_moment: float = 0.0) -> DepthFit | None:
    """The largest ``n_layer`` at the width of ``shape`` whose states and activations fit each GPU.

    ``shape`` gives everything but the depth (its ``n_layer`` is ignored); parameters come from
    ``param_counts``, states from ``model_state_bytes``, activations of ``micro_batch`` sequences of
    ``block_size`` tokens from ``activation_bytes`` (data parallelism does not shard activations).
    None when not even one layer fits. ``one_moment``: as ``largest_model``'s.
    """
    if memory_bytes <= 0 or not 0 < usable <= 1:
        raise ValueError("need memory_bytes > 0 and 0 < usable <= 1")
    budget = usable * memory_bytes

    def footprint(n_layer: int) -> tuple[int, float]:
        cfg = dataclasses.replace(shape, n_layer=n_layer)
        params = param_counts(cfg).total
        states = model_state_bytes(params, strategy, n_devices, precision, offload, one_moment * params).gpu
        return params, states + activation_bytes(cfg, micro_batch, bytes_per_act, checkpointing, flash)

    if footprint(1)[1] > budget:
        return None
    lo, hi = 1, 2  # footprint grows with depth: double past the budget, then bisect
    while footprint(hi)[1] <= budget:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if footprint(mid)[1] <= budget else (lo, mid)
    params, used = footprint(lo)
    return DepthFit(n_layer=lo, params=params, gpu_bytes=used)
