"""What mixed precision adds to a strategy: fp32 master weights beside 16-bit ones, and fp16's dynamic loss scale.

Under ``train.precision mixed`` (``lab.measure.device.Precision``) the weights the model computes with are 16-bit and
the optimizer updates fp32 masters, from which they are cast after each step. A strategy that holds its weights whole
keeps one master per weight (``Masters``); the ZeRO stages keep the masters of their shards in their units
(``lab.parallel.data.zero``), FSDP2 keeps fp32 shards and casts them at each gather (``MixedPrecisionPolicy``), and
DeepSpeed's bf16 and fp16 optimizers keep their own.

fp16's narrow range underflows small gradients: the loss is multiplied by a scale S before its backward and the
gradients divided by S before clipping (``LossScaler``). The global gradient norm, one sum over every rank, is the
non-finite check every rank agrees on: a non-finite norm skips the step and halves S; ``window`` clean steps in a row
double it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from lab.measure import memory
from lab.measure.figures import Figures


class LossScaler(Figures):
    """fp16's dynamic loss scale: ``scale`` and the clean steps since it last changed; it reports the scale in the step
    record and line."""

    line_place = 10  # the step line's first fragment

    def __init__(self, scale: float, window: int):
        self.scale, self.window, self.clean = float(scale), window, 0

    def observe(self, finite: bool) -> None:
        """After a step's gradient norm: a non-finite one halves the scale (the step is skipped), the ``window``-th
        finite one in a row doubles it."""
        if not finite:
            self.scale, self.clean = self.scale / 2, 0
            return
        self.clean += 1
        if self.clean == self.window:
            self.scale, self.clean = self.scale * 2, 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean}

    def record(self) -> dict[str, object]:
        return {"loss_scale": self.scale}

    @staticmethod
    def line(rec: dict) -> str:
        return f" | loss scale {rec['loss_scale']:g}" if "loss_scale" in rec else ""

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean = float(state["scale"]), int(state["clean_steps"])


class Masters:
    """fp32 master copies of a module's trainable weights, which then become ``dtype``: the optimizer updates the
    masters from the weights' gradients (``take_gradients``), and the weights follow them (``write_back``)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, share: Callable[[str, torch.Tensor], None]):
        """``share(name, tensor)`` gives every rank that holds ``name`` the first one's values (before the cast)."""
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.of: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                share(name, p.data)
                master = p.detach().clone(memory_format=torch.contiguous_format)
                memory.tag(master, "optimizer")
                p.data = p.data.to(dtype)
                self.pairs.append((p, master))
                self.of[id(p)] = master

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [master for _, master in self.pairs]

    def take_gradients(self) -> None:
        """The masters' fp32 gradients from the weights' (a weight unused in this step: zeros)."""
        for p, master in self.pairs:
            master.grad = torch.zeros_like(master) if p.grad is None else p.grad.to(torch.float32)

    @torch.no_grad()
    def write_back(self) -> None:
        """The weights from the masters (each rounded to the weights' dtype)."""
        for p, master in self.pairs:
            p.copy_(master)


class PrecisionStep:
    """The precision policy's part of every step, one component the step owns: the fp32 masters of the weights a
    strategy holds whole (``keep_masters``; a strategy that shards keeps its own) and fp16's loss scale (``scaler``)."""

    def __init__(self, param_dtype: torch.dtype, scaler: LossScaler | None):
        self.param_dtype, self.scaler = param_dtype, scaler
        self.masters: Masters | None = None

    def keep_masters(self, module: nn.Module, share: Callable[[str, torch.Tensor], None]) -> Masters:
        """fp32 masters of ``module``'s trainable weights (the first data-parallel rank's values: ``share``), which
        become the optimizer's; the weights are cast to ``param_dtype``."""
        self.masters = Masters(module, self.param_dtype, share)
        return self.masters

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What the autograd pass of ``loss`` starts from: fp16's loss scale times it."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def take_gradients(self) -> None:
        """The masters' fp32 gradients from the synced weights' gradients."""
        if self.masters is not None:
            self.masters.take_gradients()

    def unscale(self, norm: torch.Tensor, grads: list[list[torch.Tensor]]) -> torch.Tensor:
        """fp16: the gradients (lists of tensors that can be scaled together) and their global ``norm`` divided by the
        loss scale, which the norm's finiteness then sets for the next step; the norm unscaled."""
        if self.scaler is None:
            return norm
        norm = norm / self.scaler.scale
        for tensors in grads:
            torch._foreach_mul_(tensors, 1 / self.scaler.scale)
        self.scaler.observe(bool(torch.isfinite(norm)))
        return norm

    def write_back(self) -> None:
        """The 16-bit weights from their updated (or loaded) masters."""
        if self.masters is not None:
            self.masters.write_back()

    def zero_grad(self) -> None:
        """The 16-bit weights' gradients cleared (the optimizer clears the masters')."""
        for p, _ in self.masters.pairs if self.masters is not None else ():
            p.grad = None

    def record(self) -> dict[str, float]:
        """fp16's loss scale now, for the step's record and the summary."""
        return {} if self.scaler is None else self.scaler.record()

    def state(self) -> dict[str, dict]:
        """What a checkpoint's metadata keeps: fp16's loss scale and its clean steps."""
        return {} if self.scaler is None else {"loss_scale": self.scaler.state_dict()}

    def load_state(self, meta: dict) -> None:
        """Go on with the loss scale a checkpoint's metadata kept (one written without it leaves the initial one)."""
        if self.scaler is not None and "loss_scale" in meta:
            self.scaler.load_state_dict(meta["loss_scale"])
