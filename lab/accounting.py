"""Pure arithmetic of training: parameters, FLOPs, hardware peaks, time (and memory, below).

No torch here: every function takes a shape or plain numbers, so the analysis package and the
planner can use it without a model. ``tests/test_accounting.py`` checks each formula against a
hand computation and against the parameters of a real ``lab.model.GPT``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab.config import ModelConfig

# ---------------------------------------------------------------- shape


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


def padded_vocab(cfg: ModelConfig) -> int:
    """Rows of the embedding table: the vocabulary rounded up to ``pad_vocab_to``."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size is unresolved (set it, or take it from the tokenizer)")
    return round_up(cfg.vocab_size, max(1, cfg.pad_vocab_to))


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head


def head_dim(cfg: ModelConfig) -> int:
    return cfg.d_model // cfg.n_head


def ffn_width(cfg: ModelConfig) -> int:
    """MLP hidden width: 4·d for GELU; for SwiGLU 8/3·d rounded up to 64 (same FLOPs as 4·d GELU)."""
    if cfg.d_ff is not None:
        return cfg.d_ff
    if cfg.arch == "modern":
        return round_up(int(8 * cfg.d_model / 3), 64)
    return 4 * cfg.d_model


def uses_bias(cfg: ModelConfig) -> bool:
    return cfg.bias if cfg.bias is not None else cfg.arch == "gpt2"


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    total: int
    non_embedding: int  # Kaplan's N: without token/position embeddings and without an untied head
    embedding: int  # token table + learned positions
    head: int  # untied output head (0 when tied)
    position: int  # learned position table (0 with RoPE)

    @property
    def matmul(self) -> int:
        """Weights used in a matmul per token: the blocks plus the V×d output projection."""
        return self.non_embedding + self.embedding - self.position


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Parameter counts of ``lab.model.GPT`` built from ``cfg`` (vocab_size resolved)."""
    d, L, V = cfg.d_model, cfg.n_layer, padded_vocab(cfg)
    hd, kv, ff, b = head_dim(cfg), kv_heads(cfg), ffn_width(cfg), uses_bias(cfg)
    modern = cfg.arch == "modern"
    norm = d if modern else (2 * d if b else d)  # RMSNorm has no bias
    qkv = d * (d + 2 * kv * hd) + (d + 2 * kv * hd if b else 0)
    proj = d * d + (d if b else 0)
    if modern:
        mlp = 3 * d * ff + (2 * ff + d if b else 0)
    else:
        mlp = 2 * d * ff + (ff + d if b else 0)
    block = 2 * norm + qkv + proj + mlp
    position = 0 if modern else cfg.block_size * d
    embedding = V * d + position
    head = 0 if cfg.tie_embeddings else V * d
    non_embedding = L * block + norm
    return ParamCounts(total=embedding + non_embedding + head, non_embedding=non_embedding,
                       embedding=embedding, head=head, position=position)


# ---------------------------------------------------------------- FLOPs


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6·N_matmul + 12·L·d_attn·T (forward + backward, PaLM appendix B).

    N_matmul counts the weights used in matmuls (blocks and output head, not embedding lookups);
    the second term is the attention score and value products, counted over the full context.
    """
    n = param_counts(cfg).matmul
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_head * head_dim(cfg) * cfg.block_size


def training_flops(params: float, tokens: float) -> float:
    """The C = 6·N·D approximation."""
    return 6.0 * params * tokens


# ---------------------------------------------------------------- hardware and time

# Dense (not 2:4 sparse) tensor-core peaks in FLOP/s, from the vendors' data sheets (SXM parts).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
}
GPU_MEMORY_BYTES: dict[str, float] = {"A100": 80e9, "H100": 80e9, "H200": 141e9}


def gpu_peak_flops(gpu: str, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of a GPU by name (case-insensitive; 'NVIDIA H100 80GB HBM3' works too)."""
    key = next((k for k in GPU_PEAK_FLOPS if k.lower() in gpu.lower()), None)
    if key is None:
        raise ValueError(f"unknown GPU '{gpu}' (known: {', '.join(GPU_PEAK_FLOPS)})")
    table = GPU_PEAK_FLOPS[key]
    if dtype not in table:
        raise ValueError(f"no {dtype} peak for {key} (known: {', '.join(table)})")
    return table[dtype]


def training_seconds(flops: float, gpu: str, n_gpus: int, mfu: float, dtype: str = "bf16") -> float:
    """Wall-clock seconds to spend ``flops`` on ``n_gpus`` at a model-FLOPs utilisation ``mfu``."""
    if n_gpus <= 0 or not 0 < mfu <= 1:
        raise ValueError("need n_gpus > 0 and 0 < mfu <= 1")
    return flops / (n_gpus * gpu_peak_flops(gpu, dtype) * mfu)
