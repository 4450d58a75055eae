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
sets: ``Strategy.orthogonalizer``). The other
groups step as ``torch.optim.AdamW`` steps them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from lab.runtime.config import ConfigError

COEFFICIENTS = (3.4445, -4.775, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default
EPS = 1e-7


def parse_coefficients(text: str) -> tuple[float, float, float]:
    """``train.muon_ns_coefficients`` (``a,b,c``) as three floats; ConfigError (one line) otherwise."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"train.muon_ns_coefficients must be three numbers a,b,c, got {text!r}")
    return values  # type: ignore[return-value]


def newton_schulz(update: torch.Tensor, coefficients: Sequence[float], steps: int) -> torch.Tensor:
    """U's orthogonalization: ``steps`` iterations of X ← aX + (bA + cA²)X with A = XXᵀ, in bf16, from X = U/‖U‖
    (the wide orientation: a tall matrix is transposed and back)."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.bfloat16()
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


Orthogonalizer = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class MuonAdamW(torch.optim.AdamW):
    """AdamW over the groups without ``muon``; Muon over those with it (each group's ``lr`` and ``weight_decay``)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float, fused: bool,
                 momentum: float, nesterov: bool, ns_steps: int, ns_coefficients: Sequence[float]):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=fused)
        self.momentum, self.nesterov = momentum, nesterov
        self.ns_steps, self.ns_coefficients = ns_steps, tuple(ns_coefficients)
        self.orthogonalizer: Orthogonalizer = self.orthogonalize  # where each matrix is orthogonalized
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon's groups take matrices only")

    def orthogonalize(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every update orthogonalized here."""
        return [self.orthogonalize_one(u) for u in updates]

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
        for (group, p, _), ortho in zip(jobs, self.orthogonalizer([u for _, _, u in jobs]), strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(ortho, alpha=-group["lr"] * (0.2 * math.sqrt(max(p.shape))))
        every = self.param_groups
        self.param_groups = [g for g in every if not g["muon"]]
        try:
            super().step()
        finally:
            self.param_groups = every
