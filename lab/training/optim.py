"""The optimizer the loop asks strategies to build: AdamW with weight decay decided by role, or Muon for the hidden
matrices beside AdamW for the rest (``lab.training.muon``).

``param_groups`` runs on the freshly built model, before any strategy wraps or flattens it, and
names parameters as the model does: a flattened shard is 1-D, so a rule based on ``p.dim()``
after sharding would lose the decay of every matrix.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lab.runtime.config import ConfigError, TrainConfig
from lab.parallel import OptimizerFactory, ParamGroup
from lab.training.muon import MuonAdamW, parse_coefficients

NORMS = (nn.LayerNorm, nn.RMSNorm)


def param_groups(model: nn.Module, weight_decay: float, muon: bool = False) -> list[ParamGroup]:
    """Decay the weights of matmuls and embeddings; not norms, not biases. Frozen weights are left out.

    Decided by the owning module's type and the parameter's name; a parameter of another module
    decays when it is a matrix. Each parameter appears once (a tied weight has one owner). A model
    with ``lr_multiplier(name)`` (μP) gets one more group per multiplier other than 1; otherwise
    the groups are [decay, no decay]. With ``muon``, the matrices the model's ``muon_matrix(name)`` names are a
    group of their own (decayed), which Muon steps.
    """
    multiplier = getattr(model, "lr_multiplier", lambda name: 1.0)
    if muon and not hasattr(model, "muon_matrix"):
        raise ConfigError(f"train.optimizer muon: the model ({type(model).__name__}) names no hidden matrices "
                          "(muon_matrix)")
    groups: dict[tuple[bool, float], list[str]] = {(True, 1.0): [], (False, 1.0): []}
    matrices: list[str] = []
    seen = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or p in seen:
                continue
            seen.add(p)
            full = f"{module_name}.{name}" if module_name else name
            if muon and model.muon_matrix(full):
                matrices.append(full)
                continue
            decays = not (isinstance(module, NORMS) or name == "bias") and (
                isinstance(module, (nn.Linear, nn.Embedding)) or p.dim() >= 2)
            groups.setdefault((decays, multiplier(full)), []).append(full)
    muon_group = [ParamGroup(tuple(matrices), weight_decay, muon=True)] if muon else []
    return [ParamGroup(tuple(names), weight_decay if decays else 0.0, lr_scale)
            for (decays, lr_scale), names in groups.items()] + muon_group


def optimizer_factory(cfg: TrainConfig, device: torch.device) -> OptimizerFactory:
    """The run's optimizer (``train.optimizer``): AdamW, or Muon with AdamW."""
    if cfg.optimizer == "adamw":
        return adamw_factory(cfg, device)

    def make(groups: list[dict]) -> torch.optim.Optimizer:
        return MuonAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                         fused=device.type in ("cuda", "cpu"), momentum=cfg.muon_momentum,
                         nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                         ns_coefficients=parse_coefficients(cfg.muon_ns_coefficients))
    return make


def adamw_factory(cfg: TrainConfig, device: torch.device) -> OptimizerFactory:
    """AdamW at the run's betas (the fused kernel on CPU and CUDA); the strategy sets the learning rate each step."""
    def make(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                 fused=device.type in ("cuda", "cpu"))
    return make
