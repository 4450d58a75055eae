"""Model shapes for a sweep: the ``aspect`` family (target N → depth and width) and shape checks.

The family, for a target N counted as the sweep's ``count`` (total or non-embedding parameters,
exactly as ``lab.measure.accounting.param_counts`` counts them, embeddings included):

1. width: among the multiples of ``width_multiple``, the one whose model at depth
   ``round(d_model / aspect)`` (at least 1) has N nearest the target (in log N);
2. depth: at that width, the L in 1..max_layers whose N is nearest the target, so depth, which
   changes N in small steps, makes up for the coarse width grid;
3. heads: ``d_model / head_dim`` (``head_dim`` divides ``width_multiple``, so heads divide the width);
4. MLP width: ``round(ffn_ratio × d_model)`` when ``ffn_ratio`` is set, else the architecture's default
   (which for SwiGLU rounds up to a multiple of 64: far from 8/3 × d_model at widths below a few hundred).
"""

from __future__ import annotations

import math
from typing import Any

from lab.measure import accounting
from lab.runtime.config import ModelConfig, RunConfig

from sweeps.sweep import Family

BYTE_VOCAB = 257  # lab.data's byte tokenizer: 256 bytes and one special token


def vocab_size(base: dict[str, dict[str, Any]]) -> int:
    """The model's vocabulary: ``[base.model] vocab_size``, else what ``[base.data]``'s tokenizer asks for."""
    model = base.get("model", {})
    if model.get("vocab_size") is not None:
        return int(model["vocab_size"])
    data = RunConfig.from_dict({"data": base.get("data", {})}).data
    return BYTE_VOCAB if data.tokenizer == "bytes" else data.vocab_size


def model_config(base: dict[str, dict[str, Any]], shape: dict[str, Any]) -> ModelConfig:
    """``[base.model]`` with ``shape`` on top and the vocabulary resolved; SpecError if it cannot exist."""
    from lab.model import validate  # imports torch: only when planning

    cfg = RunConfig.from_dict({"model": {**base.get("model", {}), **shape}}).model
    cfg.vocab_size = vocab_size(base)
    validate(cfg)
    return cfg


def count(cfg: ModelConfig, which: str) -> int:
    """Total or non-embedding parameters of a shape."""
    counts = accounting.param_counts(cfg)
    return counts.total if which == "total" else counts.non_embedding


def family_shape(target: float, family: Family, which: str, base: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The shape (n_layer, d_model, n_head) the family gives a target N; see the module docstring."""
    def shape(n_layer: int, width: int) -> dict[str, int]:
        s = {"n_layer": n_layer, "d_model": width, "n_head": width // family.head_dim}
        return s if family.ffn_ratio is None else {**s, "d_ff": max(1, round(family.ffn_ratio * width))}

    def error(s: dict[str, int]) -> float:
        return abs(math.log(count(model_config(base, s), which) / target))

    def aspect_shape(width: int) -> dict[str, int]:
        return shape(min(family.max_layers, max(1, math.floor(width / family.aspect + 0.5))), width)

    def below(multiple: int) -> bool:
        return count(model_config(base, aspect_shape(multiple * family.width_multiple)), which) < target

    # N grows with the width: the first multiple whose N reaches the target, found by doubling then bisecting
    lo, hi = 0, 1  # below(lo) (or lo = 0), not below(hi)
    while below(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    width = min({max(lo, 1), hi}, key=lambda m: error(aspect_shape(m * family.width_multiple))) * family.width_multiple
    return shape(min(range(1, family.max_layers + 1), key=lambda L: error(shape(L, width))), width)
