"""The GPT: GPT-2 style or modern, chosen by ``ModelConfig.arch``.

- ``gpt2``: learned positions, LayerNorm, GELU MLP, biases (Radford et al. 2019).
- ``modern``: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases
  (the Llama family).

Pre-norm residual blocks, ``scaled_dot_product_attention``, optional tied embeddings, and the
GPT-2 init with residual projections scaled by 1/√(2·n_layer). The init is a pure function of
(seed, parameter name): every tensor draws from its own generator, so a strategy that builds the
model on the meta device and materialises only its shard gets exactly the values a one-process
run gets. The model knows nothing of devices, ranks or strategies. Parameter and FLOP formulas
live in ``lab.measure.accounting`` and are tested against ``GPT.param_counts()``.

``parametrization mup`` is μP (Yang et al. 2022, Tensor Programs V) for Adam, with width ratio
m = d_model / mup_base_width: the hidden matrices (attention and MLP weights) start with the
standard std / √m and train at the learning rate / m (``lr_multiplier``, applied through the
optimizer's parameter groups); embeddings, norms, biases and the head keep theirs; the logits are
multiplied by 1/m and attention scores use 1/d_head instead of 1/√d_head. At m = 1 only the
attention scale differs from ``standard``.

``moe_experts`` E > 0 replaces every MLP by a mixture of experts (``MoE``): a softmax router sends each
token to its top_k of E experts (each the arch's MLP, of width d_ff / G), plus S always-on shared experts.
The training loss adds the Switch load-balancing loss and the router z-loss (``GPT.forward``); evaluation
(``eval()``) returns the plain cross-entropy. E = 0 builds and computes exactly the dense model.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from lab.measure import accounting
from lab.measure.figures import Figures
from lab.runtime.config import ConfigError, ModelConfig, did_you_mean
from lab.model.plan import ColumnSplit, ContextPlan, ExpertPlan, ParallelPlan, PipelinePlan, TensorPlan

ARCHS = ("gpt2", "modern")
PARAMETRIZATIONS = ("standard", "mup")


def width_ratio(cfg: ModelConfig) -> float:
    """μP's width multiplier m = d_model / mup_base_width (1 under standard parametrization)."""
    if cfg.parametrization != "mup" or cfg.mup_base_width is None:
        return 1.0
    return cfg.d_model / cfg.mup_base_width


# Sizes far beyond any model the lab trains or a sweep plans at its largest budget (1e30 FLOPs: d_model 707,904,
# 11,061 heads, 48 layers); llama3-70b has 80 layers, d_model 8192, d_ff 28672
LARGEST = {"n_layer": 2**16, "n_head": 2**20, "n_kv_head": 2**20, "d_model": 2**24, "d_ff": 2**26,
           "block_size": 2**24, "vocab_size": 2**26, "pad_vocab_to": 2**16}


def validate(cfg: ModelConfig) -> None:
    """Raise ConfigError for a shape the model cannot be built with."""
    if cfg.arch not in ARCHS:
        raise ConfigError(f"model.arch must be gpt2 or modern, got '{cfg.arch}'{did_you_mean(cfg.arch, ARCHS)}")
    for name in ("n_layer", "n_head", "d_model", "block_size", "pad_vocab_to"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"model.{name} must be positive, got {getattr(cfg, name)}")
    for name, most in LARGEST.items():  # before anything is built: a crafted size would take hours to refuse
        if (value := getattr(cfg, name)) is not None and value > most:
            raise ConfigError(f"model.{name} must be at most {most:,}, got {value:,}")
    if cfg.d_model % cfg.n_head:
        raise ConfigError(f"model.n_head ({cfg.n_head}) must divide model.d_model ({cfg.d_model})")
    kv = accounting.kv_heads(cfg)
    if kv <= 0 or cfg.n_head % kv:
        raise ConfigError(f"model.n_kv_head ({kv}) must divide model.n_head ({cfg.n_head})")
    if cfg.arch == "modern" and accounting.head_dim(cfg) % 2:
        raise ConfigError(f"RoPE needs an even head dimension, got {accounting.head_dim(cfg)}")
    if cfg.d_ff is not None and cfg.d_ff <= 0:
        raise ConfigError(f"model.d_ff must be positive, got {cfg.d_ff}")
    if cfg.vocab_size is not None and cfg.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size must be positive, got {cfg.vocab_size}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.parametrization not in PARAMETRIZATIONS:
        raise ConfigError(f"model.parametrization must be standard or mup, got '{cfg.parametrization}'"
                          f"{did_you_mean(cfg.parametrization, PARAMETRIZATIONS)}")
    if cfg.mup_base_width is not None:
        if cfg.parametrization != "mup":
            raise ConfigError("model.mup_base_width has no effect under model.parametrization standard "
                              "(set model.parametrization mup)")
        if cfg.mup_base_width <= 0:
            raise ConfigError(f"model.mup_base_width must be positive, got {cfg.mup_base_width}")
    validate_moe(cfg)


def validate_moe(cfg: ModelConfig) -> None:
    """Raise ConfigError for a mixture-of-experts shape that cannot be built (``accounting.moe_shape_problem``)."""
    problem = accounting.moe_shape_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)


# ---------------------------------------------------------------- rotary positions


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [length, head_dim/2] for rotating pairs (x_i, x_{i+d/2})."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, hd] by position; cos/sin are [T, hd/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


# ---------------------------------------------------------------- blocks


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "modern":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=accounting.uses_bias(cfg))


class Attention(nn.Module):
    """Causal self-attention; grouped-query when n_kv_head < n_head; RoPE in the modern arch."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, accounting.kv_heads(cfg)
        self.head_dim = accounting.head_dim(cfg)
        bias = accounting.uses_bias(cfg)
        self.qkv = nn.Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=bias)
        self.proj.is_residual_output = True
        self.dropout = cfg.dropout
        self.rotary = cfg.arch == "modern"
        # None: torch's 1/√d_head; μP's 1/d_head keeps the scores' scale as heads widen.
        self.scale = 1.0 / self.head_dim if cfg.parametrization == "mup" else None
        # (q, k, v, scale) -> output, when the keys live elsewhere (context parallelism: lab.parallel.axes.context)
        self.attend: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.qkv(x)
        T = qkv.shape[1]  # the whole sequence even when x is a shard of it (sequence parallelism)
        q, k, v = qkv.split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1)
        q = rearrange(q, "b t (h d) -> b h t d", h=self.n_head)
        k = rearrange(k, "b t (h d) -> b h t d", h=self.n_kv_head)
        v = rearrange(v, "b t (h d) -> b h t d", h=self.n_kv_head)
        if self.rotary:
            cos, sin = rope[0][:T], rope[1][:T]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.attend is not None:
            y = self.attend(q, k, v, self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0,
                                               enable_gqa=self.n_kv_head != self.n_head, scale=self.scale)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (modern): down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        ff, bias = width or accounting.ffn_width(cfg), accounting.uses_bias(cfg)
        self.gated = cfg.arch == "modern"
        self.up = nn.Linear(cfg.d_model, 2 * ff if self.gated else ff, bias=bias)
        self.down = nn.Linear(ff, cfg.d_model, bias=bias)
        self.down.is_residual_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.down(h)


class Experts(nn.ModuleList):
    """A mixture of experts' routed experts, run in one call: each ``(index, rows)`` through expert ``index`` apart
    (a strategy that gathers a module's weights around its forward gathers them once for every call). ``tap``, when
    set, takes each call's weights (``tap("<index>.<name>", weight)``) and returns what the call runs with: a meter
    that reads each call's part of a weight's gradient (``lab.parallel.noise``)."""

    tap: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    def forward(self, calls: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        if self.tap is None:
            return [self[index](rows) for index, rows in calls]
        return [torch.func.functional_call(self[index], {name: self.tap(f"{index}.{name}", weight)
                                                        for name, weight in self[index].named_parameters()}, (rows,))
                for index, rows in calls]


class MoE(nn.Module):
    """Token-choice top-k mixture of experts (Shazeer et al. 2017; Switch, Fedus et al. 2021).

    A bias-free linear router gives each token a softmax over the E experts; the token goes to its top_k,
    and the experts' outputs are summed weighted by those probabilities divided by their sum (``moe_normalize_gates``,
    by default when top_k > 1, as Mixtral: at k = 2 raw gates ended 0.48 nats worse on the demo, README) or raw (as
    Switch at k = 1). Each expert is the arch's MLP of width d_ff / G; S shared experts (DeepSeekMoE) are one
    always-on MLP of width S · d_ff / G. Dropless by default; with a capacity factor c, each expert takes at
    most ceil(c · N · top_k / E) of the N tokens' assignments, every first choice before any second one and
    tokens in order within a choice; a dropped assignment adds nothing (the token keeps its residual).

    Every expert runs every step, on no rows when none reach it, so an unused expert gets a zero gradient.
    The forward leaves ``aux_loss`` (load balance · coef + z-loss · coef, on this micro-batch) for the model
    to add, and counts per expert, dropped assignments and router entropy (``take_counts``) in training.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.normalize_gates = cfg.moe_top_k > 1 if cfg.moe_normalize_gates is None else cfg.moe_normalize_gates
        width = accounting.expert_width(cfg)
        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        self.experts = Experts(MLP(cfg, width) for _ in range(self.n_experts))
        self.shared = MLP(cfg, cfg.moe_shared_experts * width) if cfg.moe_shared_experts else None
        self.aux_loss: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # [E + 3]: assignments per expert, dropped, entropy sum, tokens
        # rows per expert -> their outputs, when the experts live elsewhere (lab.parallel.axes.experts)
        self.exchange: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat).float()
        probs = logits.softmax(dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.normalize_gates:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        kept = self.kept(choice)
        assigned = [torch.where((choice == e) & kept) for e in range(self.n_experts)]  # (token, slot) per expert
        rows = [flat[token] for token, _ in assigned]
        outputs = self.exchange(rows) if self.exchange is not None else self.experts(list(enumerate(rows)))
        out = torch.zeros_like(flat)
        for (token, slot), y in zip(assigned, outputs):
            out.index_add_(0, token, (y * gate[token, slot, None]).to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        self.aux_loss = (self.aux_loss_coef * balance_loss(probs, choice)
                         + self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean())
        if self.training and torch._C._current_graph_task_id() == -1:  # not an activation checkpoint's recompute
            self.count(probs, choice, kept)
        return out.view_as(x)

    def kept(self, choice: torch.Tensor) -> torch.Tensor:
        """Which of the [N, k] assignments an expert takes: all (dropless), or the first ``capacity`` of each."""
        if self.capacity_factor is None:
            return torch.ones_like(choice, dtype=torch.bool)
        n, k = choice.shape
        capacity = math.ceil(self.capacity_factor * n * k / self.n_experts)
        order = choice.t().reshape(-1)  # every token's first choice, then every second choice, ...
        position = F.one_hot(order, self.n_experts).cumsum(0).gather(1, order[:, None]).squeeze(1) - 1
        return (position < capacity).view(k, n).t()

    @torch.no_grad()
    def count(self, probs: torch.Tensor, choice: torch.Tensor, kept: torch.Tensor) -> None:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
        step = torch.cat([torch.bincount(choice.flatten(), minlength=self.n_experts).float(),
                          torch.stack([(~kept).sum().float(), entropy, torch.tensor(float(len(probs)),
                                                                                  device=probs.device)])])
        self.counts = step if self.counts is None else self.counts + step

    def take_counts(self) -> torch.Tensor:
        """The counts since the last call ([E + 3], zeros when none), reset."""
        counts = self.counts if self.counts is not None else torch.zeros(self.n_experts + 3,
                                                                         device=self.router.weight.device)
        self.counts = None
        return counts


def balance_loss(probs: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Switch's load-balancing loss E · Σ_i f_i · P_i: f_i the fraction of the N · k assignments that chose
    expert i (not differentiable), P_i its mean router probability; 1 when balanced, E when one expert takes all."""
    n_experts = probs.shape[-1]
    fraction = torch.bincount(choice.flatten(), minlength=n_experts).float() / choice.numel()
    return n_experts * (fraction * probs.mean(dim=0)).sum()


def router_meters(counts: torch.Tensor, top_k: int) -> dict[str, float]:
    """Step figures from the summed ``MoE.take_counts`` of every MoE layer ([layers, E + 3]): the most loaded
    expert over the mean (the worst layer), the assignments each expert took (summed over layers), dropped
    assignments (count and fraction) and router entropy (nats, mean over tokens and layers)."""
    load, dropped, entropy, tokens = counts[:, :-3], counts[:, -3], counts[:, -2], counts[:, -1]
    if tokens.sum() == 0:
        return {}
    return {"moe_load_max_over_mean": (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-30)).max().item(),
            "moe_tokens_per_expert": [int(n) for n in load.sum(dim=0).tolist()],
            "moe_dropped_tokens": int(dropped.sum().item()),
            "moe_dropped_fraction": (dropped.sum() / (tokens.sum() * top_k)).item(),
            "moe_router_entropy": (entropy.sum() / tokens.sum()).item()}


class RouterFigures(Figures):
    """A mixture's router as its run reports it: since the last logged step, the counts of every rank summed
    (``sum_tokens``: each token once) into ``router_meters``; the last of them in the summary."""

    line_place = 30

    def __init__(self, model: GPT, sum_tokens: Callable[[torch.Tensor], torch.Tensor]):
        self.model, self.sum_tokens, self.last = model, sum_tokens, {}

    @classmethod
    def of(cls, model: GPT, sum_tokens: Callable[[torch.Tensor], torch.Tensor]) -> RouterFigures | None:
        """The router's figures of ``model``; None for a dense one."""
        return cls(model, sum_tokens) if model.cfg.moe_experts else None

    def record(self) -> dict[str, object]:
        self.last = router_meters(self.sum_tokens(self.model.take_router_counts()).cpu(), self.model.cfg.moe_top_k)
        return self.last

    def meters(self) -> dict[str, object]:
        return {"moe_last_step": self.last} if self.last else {}

    @staticmethod
    def line(rec: dict) -> str:
        """The router's figures."""
        if "moe_load_max_over_mean" not in rec:
            return ""
        per_expert = rec["moe_tokens_per_expert"]
        return (f" | moe load max/mean {rec['moe_load_max_over_mean']:.2f}, tokens/expert {min(per_expert):,}-"
                f"{max(per_expert):,}, dropped {rec['moe_dropped_tokens']:,}, "
                f"router entropy {rec['moe_router_entropy']:.3f}")


class NextTokenLoss(nn.Module):
    """The head's logits from the final norm's output and the head's weight, the padding rows cut off and divided by
    ``divisor`` (μP's width ratio), or their mean cross-entropy against the targets. No weights of its own: tensor
    parallelism replaces it, through the model's plan, with the vocabulary-parallel loss."""

    def __init__(self, vocab_size: int, divisor: float = 1.0):
        super().__init__()
        self.vocab_size, self.divisor = vocab_size, divisor

    def forward(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        logits = F.linear(x, weight)[..., : self.vocab_size]
        if self.divisor != 1:
            logits = logits / self.divisor
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2, self.mlp = make_norm(cfg), MoE(cfg) if cfg.moe_experts else MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), rope))
        return x + self.dropout(self.mlp(self.norm2(x)))


# ---------------------------------------------------------------- the model


class GPT(nn.Module):
    # the model's features that report on its run, in one list (``figures`` makes those it has, each with ``of``; the
    # step line shows the fragments of all of them, ``lab.parallel.step_line``)
    FIGURES: ClassVar[tuple[type[RouterFigures], ...]] = (RouterFigures,)

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        """Build the model and give it its initial weights (nothing is allocated on the meta device)."""
        super().__init__()
        validate(cfg)
        self.cfg, self.seed = cfg, seed
        self.width = width_ratio(cfg)
        self.vocab_size, padded = cfg.vocab_size, accounting.padded_vocab(cfg)
        self.wte = nn.Embedding(padded, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.arch == "gpt2" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        # Tied: the head multiplies by the embedding table itself (one parameter, owned by one module).
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, padded, bias=False)
        self.loss = NextTokenLoss(self.vocab_size, self.width if cfg.parametrization == "mup" else 1.0)
        self.positions: torch.Tensor | None = None  # the tokens' global positions when they are a shard's
        if cfg.arch == "modern":
            self.register_buffer("rope_cos", torch.empty(cfg.block_size, accounting.head_dim(cfg) // 2),
                                 persistent=False)
            self.register_buffer("rope_sin", torch.empty_like(self.rope_cos), persistent=False)
        self.init_weights()

    def initial_value(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The initial value of parameter or buffer ``name``, full size (``shape``, by default the live
        parameter's: a model whose layers were split across ranks passes the whole one), on the CPU.

        GPT-2 init: linear and embedding weights N(0, 0.02), residual output projections
        N(0, 0.02/√(2·n_layer)), biases 0, norm weights 1; RoPE tables computed. Under μP the hidden
        matrices' std is divided by √m (``is_hidden``). Each parameter
        draws from a generator seeded by (seed, name), independent of every other parameter.
        """
        if name in ("rope_cos", "rope_sin"):
            cos, sin = rope_tables(accounting.head_dim(self.cfg), self.cfg.block_size, self.cfg.rope_theta)
            return cos if name == "rope_cos" else sin
        module_name, _, kind = name.rpartition(".")
        module, shape = self.get_submodule(module_name), shape or self.get_parameter(name).shape
        if kind == "bias":
            return torch.zeros(shape, device="cpu")
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return torch.ones(shape, device="cpu")
        residual = getattr(module, "is_residual_output", False)
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02
        if self.is_hidden(name):
            std /= math.sqrt(self.width)
        # torch's CPU generator keeps 32 bits of its seed: mix (seed, name) into 32 bits.
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}/{name}".encode()).digest()[:4], "little")
        generator = torch.Generator(device="cpu").manual_seed(seed)
        return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)

    def is_hidden(self, name: str) -> bool:
        """Whether parameter ``name`` is a hidden matrix under μP: a linear layer's weight inside a block."""
        return (self.cfg.parametrization == "mup" and name.startswith("blocks.") and name.endswith(".weight")
                and isinstance(self.get_submodule(name.rpartition(".")[0]), nn.Linear))

    def muon_matrix(self, name: str) -> bool:
        """Whether Muon steps parameter ``name`` (``train.optimizer muon``): a linear layer's weight inside a block
        (attention's and the MLP's projections, each expert's), a mixture's router aside (AdamW's, as the
        embeddings, the head, norms and biases)."""
        return (name.startswith("blocks.") and name.endswith(".weight") and not name.endswith(".router.weight")
                and isinstance(self.get_submodule(name.rpartition(".")[0]), nn.Linear))

    def lr_multiplier(self, name: str) -> float:
        """The factor on the run's learning rate for parameter ``name``: 1/m for μP's hidden matrices, else 1."""
        return 1.0 / self.width if self.is_hidden(name) else 1.0

    @torch.no_grad()
    def init_weights(self) -> None:
        """Set every parameter and buffer to its initial value, wherever it lives (meta tensors are skipped)."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if not tensor.is_meta:
                tensor.copy_(self.initial_value(name))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for ``idx`` [B, T], or the mean cross-entropy when targets are given."""
        loss = self.output(self.run_blocks(self.embed(idx), range(len(self.blocks))), targets)
        if targets is not None and self.training:
            for moe in self.moe_layers():
                loss = loss + moe.aux_loss
        return loss

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The hidden state [B, T, d] of tokens ``idx`` [B, T]: token (and learned position) embeddings."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(self.positions if self.positions is not None else torch.arange(T, device=idx.device))
        return self.drop(x)

    def run_blocks(self, x: torch.Tensor, indices: range) -> torch.Tensor:
        """The hidden state ``x`` through the blocks ``indices``, in order."""
        rope = (self.rope_cos, self.rope_sin) if self.cfg.arch == "modern" else None
        if rope is not None and self.positions is not None:
            rope = (rope[0][self.positions], rope[1][self.positions])
        for i in indices:
            x = self.blocks[i](x, rope)
        return x

    def stage(self, x: torch.Tensor, targets: torch.Tensor | None, indices: range, first: bool, last: bool
              ) -> torch.Tensor:
        """A pipeline stage's part of the forward: tokens ``x`` embedded (``first``) or a hidden state, through the
        blocks ``indices``, to the loss against ``targets`` (``last``) or the hidden state to send on."""
        h = self.run_blocks(self.embed(x) if first else x, indices)
        return self.output(h, targets) if last else h

    def aux_loss(self, indices: range) -> torch.Tensor | None:
        """The auxiliary losses the mixture-of-experts layers of blocks ``indices`` left in their last forward, summed
        in order (None for a dense model): what a pipeline stage adds to its part of the loss."""
        losses = [self.blocks[i].mlp.aux_loss for i in indices if isinstance(self.blocks[i].mlp, MoE)]
        return functools.reduce(torch.add, losses) if losses else None

    def moe_layers(self) -> list[MoE]:
        """The blocks' mixture-of-experts MLPs (none in a dense model)."""
        return [block.mlp for block in self.blocks if block is not None and isinstance(block.mlp, MoE)]

    def figures(self, sum_tokens: Callable[[torch.Tensor], torch.Tensor]) -> list[Figures]:
        """What this model reports on its run (``lab.measure.figures``): a mixture's router; ``sum_tokens`` sums
        per-token figures over the run's ranks."""
        return [part for kind in self.FIGURES if (part := kind.of(self, sum_tokens)) is not None]

    def take_router_counts(self) -> torch.Tensor | None:
        """Every MoE layer's counts since the last call ([layers, E + 3], for ``router_meters``; zeros for a block this
        model does not hold, a pipeline stage's other blocks), or None (dense)."""
        if not self.cfg.moe_experts:
            return None
        device = self.norm_f.weight.device if self.norm_f is not None else next(self.parameters()).device
        return torch.stack([block.mlp.take_counts() if block is not None else
                            torch.zeros(self.cfg.moe_experts + 3, device=device) for block in self.blocks])

    def output(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """Final norm and head: logits, or the mean cross-entropy against ``targets``."""
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return self.loss(self.norm_f(x), weight, targets)

    def parallel_plan(self) -> ParallelPlan:
        """How the parallel transforms may cut this model (``lab.model.plan``): the blocks are the units,
        ``output`` the head; tensor parallelism splits QKV and the MLP's up projection by columns (query and
        key/value heads apart, GQA's key/value heads replicated when fewer than the ranks), the attention
        output and the MLP's down projection by rows, the embedding and the head by vocabulary rows; a pipeline
        runs the embedding, then the blocks (a stage holds some of them: the others are None), then ``output``."""
        cfg = self.cfg
        heads, kv, head_dim = cfg.n_head, accounting.kv_heads(cfg), accounting.head_dim(cfg)
        ff = accounting.ffn_width(cfg)
        column, row, norms = {}, [], []
        held = [(i, block) for i, block in enumerate(self.blocks) if block is not None]
        for i, block in held:
            column[f"blocks.{i}.attn.qkv"] = ColumnSplit((heads * head_dim, kv * head_dim, kv * head_dim),
                                                         (heads, kv, kv))
            row.append(f"blocks.{i}.attn.proj")
            if isinstance(block.mlp, MLP):  # a mixture of experts is not split by tensor parallelism
                column[f"blocks.{i}.mlp.up"] = ColumnSplit((ff, ff) if block.mlp.gated else (ff,))
                row.append(f"blocks.{i}.mlp.down")
            norms += [f"blocks.{i}.norm1", f"blocks.{i}.norm2"]
        tensor = TensorPlan(column=column, row=row, embedding="wte", loss="loss",
                            head_weight="wte.weight" if self.lm_head is None else "lm_head.weight",
                            final_norm="norm_f", sequence_norms=norms + ["norm_f"],
                            positions=None if self.wpe is None else "wpe", vocab_size=self.vocab_size,
                            logit_divisor=self.width, split_heads=self._split_heads, config=cfg)
        pipeline = PipelinePlan(embed="embed", run="run_blocks", head="output", stage="stage",
                                units=[f"blocks.{i}" for i in range(len(self.blocks))],
                                first=["wte"] + ([] if self.wpe is None else ["wpe"]),
                                last=["norm_f", "wte" if self.lm_head is None else "lm_head"], width=cfg.d_model,
                                aux_loss="aux_loss")
        moe = [f"blocks.{i}.mlp" for i, block in held if isinstance(block.mlp, MoE)]
        experts = ExpertPlan(layers=moe, count=cfg.moe_experts, config=cfg) if moe else None
        context = ContextPlan(attention=[f"blocks.{i}.attn" for i, _ in held], positions="positions",
                              length=cfg.block_size, kv_values=self._kv_values)
        return ParallelPlan(units=[f"blocks.{i}" for i, _ in held], initial_value=self.initial_value,
                            head="output", tensor=tensor, pipeline=pipeline, experts=experts, context=context)

    def _kv_values(self) -> int:
        """Key and value values per token of one attention layer as it is now (its share after a split of heads)."""
        attention = next(block.attn for block in self.blocks if block is not None)
        return 2 * attention.n_kv_head * attention.head_dim

    def _split_heads(self, n: int) -> None:
        """Each attention now holds 1/n of the query heads and of the key/value heads (at least one)."""
        for block in self.blocks:
            block.attn.n_head, block.attn.n_kv_head = self.cfg.n_head // n, max(accounting.kv_heads(self.cfg) // n, 1)

    def param_counts(self) -> accounting.ParamCounts:
        """Counts from the live parameters (tied weights once), to check ``accounting.param_counts``."""
        total = sum(p.numel() for p in self.parameters())
        position = self.wpe.weight.numel() if self.wpe is not None else 0
        embedding = self.wte.weight.numel() + position
        head = 0 if self.lm_head is None else self.lm_head.weight.numel()
        inactive = sum(sum(p.numel() for expert in moe.experts[moe.top_k:] for p in expert.parameters())
                       for moe in self.moe_layers())  # the experts a token skips: any E − top_k of them
        return accounting.ParamCounts(total=total, non_embedding=total - embedding - head, embedding=embedding,
                                      head=head, position=position, inactive=inactive)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` [B, T] (greedy when temperature is 0)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
