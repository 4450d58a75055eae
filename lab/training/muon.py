"""Muon for the hidden matrices, AdamW for the rest, as one optimizer (Jordan et al. 2024; Moonlight, Liu et al. 2025).

Muon keeps one momentum buffer per matrix. Each step, for each matrix W with gradient G (``torch.optim.Muon``'s
update, to the bit):

    M ← M + (1 − μ)(G − M)                 momentum (μ: ``train.muon_momentum``)
    U ← G + μ(M − G)  (Nesterov)  or  M
    O ← NewtonSchulz(U)                    ``ns_steps`` quintic iterations in bf16: U's singular values pushed to ~1
    W ← W (1 − lr · λ) − lr · 0.2 · √max(rows, cols) · O

The factor 0.2 · √max(rows, cols) (Moonlight's RMS matching, torch's ``adjust_lr_fn="match_rms_adamw"``) gives the
update the RMS of a typical AdamW update, so that Muon's matrices and AdamW's other weights share the schedule's
learning rate and weight decay. The orthogonalization needs each matrix whole; ``orthogonalizer`` decides where each
one is computed (here by default; over a data axis, by one owner rank each: ``lab.parallel.owners``, which a strategy
sets: ``Strategy.orthogonalizer``). The other groups step as ``torch.optim.AdamW`` steps them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lab.parallel.owners import Orthogonalizer, Part, newton_schulz, rms_scale
from lab.runtime.config import ConfigError


def parse_coefficients(text: str) -> tuple[float, float, float]:
    """``train.muon_ns_coefficients`` (``a,b,c``) as three floats; ConfigError (one line) otherwise."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"train.muon_ns_coefficients must be three numbers a,b,c, got {text!r}")
    return values  # type: ignore[return-value]


class MuonAdamW(torch.optim.AdamW):
    """AdamW over the groups without ``muon``; Muon over those with it (each group's ``lr`` and ``weight_decay``).

    Its tensors may be whole matrices or parts of them (a sharding strategy's): the momentum and the final update are
    elementwise, and ``orthogonalizer`` (tensors, their updates) -> each tensor's parts, set by the strategy that
    places them, brings each matrix's update together for its orthogonalization."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float, fused: bool,
                 momentum: float, nesterov: bool, ns_steps: int, ns_coefficients: Sequence[float]):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=fused)
        self.momentum, self.nesterov = momentum, nesterov
        self.ns_steps, self.ns_coefficients = ns_steps, tuple(ns_coefficients)
        self.orthogonalizer: Orthogonalizer = self.orthogonalize  # where each matrix is orthogonalized
        for group in self.param_groups:
            group.setdefault("muon", False)

    def orthogonalize(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[list[Part]]:
        """Every update orthogonalized here: each tensor a whole matrix."""
        return [[(None, self.orthogonalize_one(u), rms_scale(t.shape))] for t, u in zip(tensors, updates, strict=True)]

    def orthogonalize_one(self, update: torch.Tensor) -> torch.Tensor:
        return newton_schulz(update, self.ns_coefficients, self.ns_steps)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        jobs = []
        for group in self.param_groups:
            for p in group["params"] if group["muon"] else []:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - self.momentum)
                jobs.append((group, p, p.grad.lerp(buf, self.momentum) if self.nesterov else buf))
        every_part = self.orthogonalizer([p for _, p, _ in jobs], [u for _, _, u in jobs])
        for (group, p, _), parts in zip(jobs, every_part, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's: this rank's rows
            for where, ortho, scale in parts:
                target, ortho = (local, ortho) if where is None else (local.view(-1)[where], ortho.reshape(-1))
                target.add_(ortho, alpha=-group["lr"] * scale)
        every = self.param_groups
        self.param_groups = [g for g in every if not g["muon"]]
        try:
            super().step()
        finally:
            self.param_groups = every
