"""Pure arithmetic of training: parameters, FLOPs, memory and communication (GPU peaks and time:
``lab.measure.hardware``).

No torch and nothing else from ``lab`` here: every function takes a shape (any object with the
``ModelShape`` attributes, such as ``lab.runtime.config.ModelShape``) or plain numbers, so the analysis
package, the sweep planner and the run planner can use it without a model.
``tests/test_accounting.py`` checks each formula against a hand computation and against the
parameters of a real ``lab.model.gpt.GPT``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """The fields of a model's shape that the formulas read (``lab.runtime.config.ModelShape`` has them all)."""

    arch: str
    n_layer: int
    n_head: int
    n_kv_head: int | None
    d_model: int
    d_ff: int | None
    block_size: int
    vocab_size: int | None
    pad_vocab_to: int
    tie_embeddings: bool
    bias: bool | None

# ---------------------------------------------------------------- shape


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


def padded_vocab(cfg: ModelShape) -> int:
    """Rows of the embedding table: the vocabulary rounded up to ``pad_vocab_to``."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size is unresolved (set it, or take it from the tokenizer)")
    return round_up(cfg.vocab_size, max(1, cfg.pad_vocab_to))


def kv_heads(cfg: ModelShape) -> int:
    return cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head


def head_dim(cfg: ModelShape) -> int:
    return cfg.d_model // cfg.n_head


def ffn_width(cfg: ModelShape) -> int:
    """MLP hidden width: 4·d for GELU; for SwiGLU 8/3·d rounded up to 64 (same FLOPs as 4·d GELU)."""
    if cfg.d_ff is not None:
        return cfg.d_ff
    if cfg.arch == "modern":
        return round_up(int(8 * cfg.d_model / 3), 64)
    return 4 * cfg.d_model


def uses_bias(cfg: ModelShape) -> bool:
    return cfg.bias if cfg.bias is not None else cfg.arch == "gpt2"


def moe_experts(cfg: ModelShape) -> int:
    """Routed experts per MLP (0: dense); a shape without the MoE fields is dense."""
    return getattr(cfg, "moe_experts", 0) or 0


def expert_width(cfg: ModelShape) -> int:
    """Hidden width of one expert: the MLP's width over the granularity G."""
    return ffn_width(cfg) // getattr(cfg, "moe_granularity", 1)


def moe_shape_problem(cfg: ModelShape) -> str | None:
    """Why ``cfg``'s mixture-of-experts fields cannot build a model (one line), or None when they can."""
    experts = moe_experts(cfg)
    if experts < 0:
        return f"model.moe_experts must be >= 0 (0: dense), got {experts}"
    if experts == 0:
        return "model.moe_shared_experts needs routed experts (set model.moe_experts)" \
            if getattr(cfg, "moe_shared_experts", 0) else None
    if not 1 <= cfg.moe_top_k <= experts:
        return f"model.moe_top_k must be in [1, model.moe_experts = {experts}], got {cfg.moe_top_k}"
    ff = ffn_width(cfg)
    if cfg.moe_granularity <= 0 or ff % cfg.moe_granularity:
        return f"model.moe_granularity ({cfg.moe_granularity}) must be a positive divisor of the MLP width ({ff})"
    if cfg.moe_shared_experts < 0:
        return f"model.moe_shared_experts must be >= 0, got {cfg.moe_shared_experts}"
    for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        if getattr(cfg, name) < 0:
            return f"model.{name} must be >= 0, got {getattr(cfg, name)}"
    if cfg.moe_capacity_factor is not None and cfg.moe_capacity_factor <= 0:
        return f"model.moe_capacity_factor must be positive (none: dropless), got {cfg.moe_capacity_factor}"
    return None


def mlp_params(cfg: ModelShape, width: int) -> int:
    """Parameters of one of the arch's MLPs of hidden width ``width`` (SwiGLU: gate, up and down)."""
    b = uses_bias(cfg)
    if cfg.arch == "modern":
        return 3 * cfg.d_model * width + (2 * width + cfg.d_model if b else 0)
    return 2 * cfg.d_model * width + (width + cfg.d_model if b else 0)


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    total: int
    non_embedding: int  # Kaplan's N: without token/position embeddings and without an untied head
    embedding: int  # token table + learned positions
    head: int  # untied output head (0 when tied)
    position: int  # learned position table (0 with RoPE)
    inactive: int = 0  # routed experts' weights a token does not use (experts − top_k per MoE layer)

    @property
    def matmul(self) -> int:
        """Weights used in a matmul per token: the blocks plus the V×d output projection (every expert)."""
        return self.non_embedding + self.embedding - self.position

    @property
    def active(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (``total`` when dense)."""
        return self.total - self.inactive

    @property
    def active_matmul(self) -> int:
        """Matmul weights one token uses: ``matmul`` less the experts it skips (the router included)."""
        return self.matmul - self.inactive


def param_counts(cfg: ModelShape) -> ParamCounts:
    """Parameter counts of ``lab.model.gpt.GPT`` built from ``cfg`` (vocab_size resolved).

    A mixture-of-experts MLP (``moe_experts`` E > 0) holds a d×E router (no bias), E routed experts of width
    w = d_ff / G and, with S shared experts, one MLP of width S·w; a token uses the router, top_k experts and
    the shared ones: the other E − top_k experts of every layer are ``inactive``."""
    d, L, V = cfg.d_model, cfg.n_layer, padded_vocab(cfg)
    hd, kv, b = head_dim(cfg), kv_heads(cfg), uses_bias(cfg)
    modern, norm = cfg.arch == "modern", _norm_params(cfg)
    qkv = d * (d + 2 * kv * hd) + (d + 2 * kv * hd if b else 0)
    proj = d * d + (d if b else 0)
    experts, inactive = moe_experts(cfg), 0
    if experts:
        width, shared = expert_width(cfg), cfg.moe_shared_experts
        mlp = d * experts + experts * mlp_params(cfg, width) + (mlp_params(cfg, shared * width) if shared else 0)
        inactive = L * (experts - cfg.moe_top_k) * mlp_params(cfg, width)
    else:
        mlp = mlp_params(cfg, ffn_width(cfg))
    block = 2 * norm + qkv + proj + mlp
    position = 0 if modern else cfg.block_size * d
    embedding = V * d + position
    head = 0 if cfg.tie_embeddings else V * d
    non_embedding = L * block + norm
    return ParamCounts(total=embedding + non_embedding + head, non_embedding=non_embedding,
                       embedding=embedding, head=head, position=position, inactive=inactive)


def stage_units(sizes: Sequence[float], parts: int) -> list[range]:
    """The pipeline's split, stated once: units of ``sizes`` (their parameters, in order) cut into ``parts``
    consecutive runs, none empty, whose largest sum is the smallest possible (among equal ones, the one whose later
    runs are longest). The first stage also holds the embedding, the last the final norm and head."""
    n = len(sizes)
    prefix = [0.0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: the smallest largest run over cuts of the first i units into k runs; cut[k][i]: where its last starts
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    runs, end = [], n
    for k in range(parts, 0, -1):
        runs.append(range(cut[k][end], end))
        end = cut[k][end]
    return runs[::-1]


def block_params(cfg: ModelShape, tp: int = 1) -> tuple[int, int]:
    """(parameters of one block on each rank of a tensor-parallel group of ``tp``, of which routed experts): the
    query heads, the MLP's hidden units (their rows, biases and down-projection columns) and the attention output's
    columns split ``tp`` ways; the key/value heads too, or, when fewer than ``tp``, one per rank (replicated); norms,
    row-parallel biases and a mixture of experts (router, experts, shared experts) whole."""
    d, b, hd = cfg.d_model, int(uses_bias(cfg)), head_dim(cfg)
    queries, kv = cfg.n_head // tp, max(kv_heads(cfg) // tp, 1)
    attention = (queries + 2 * kv) * hd * (d + b) + d * queries * hd + d * b
    experts, routed = moe_experts(cfg), 0
    if experts:
        width, shared = expert_width(cfg), cfg.moe_shared_experts
        routed = experts * mlp_params(cfg, width)
        mlp = d * experts + routed + (mlp_params(cfg, shared * width) if shared else 0)
    else:
        hidden = ffn_width(cfg) // tp
        mlp = (2 if cfg.arch == "modern" else 1) * hidden * (d + b) + d * hidden + d * b
    return 2 * _norm_params(cfg) + attention + mlp, routed


def rank_params(cfg: ModelShape, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(parameters, of which routed experts) one rank of the fullest pipeline stage holds: its blocks
    (``stage_units``) split ``tp`` ways (``block_params``) with 1 / ``ep`` of their routed experts, plus the
    embedding's vocabulary rows (split ``tp`` ways) and learned positions on the first stage, the final norm and the
    head's rows on the last (a tied head: a copy of the embedding's, one weight in a single stage)."""
    block, routed = block_params(cfg, tp)
    per_block = block - routed + routed / ep
    rows = padded_vocab(cfg) // tp * cfg.d_model
    first = rows + (0 if cfg.arch == "modern" else cfg.block_size * cfg.d_model)
    last = _norm_params(cfg) + (rows if not cfg.tie_embeddings or pp > 1 else 0)
    runs = stage_units([per_block] * cfg.n_layer, pp)
    stages = [(len(run) * per_block + (first if s == 0 else 0) + (last if s == pp - 1 else 0), len(run) * routed / ep)
              for s, run in enumerate(runs)]
    return max(stages)


def stage_params(cfg: ModelShape, pp: int) -> float:
    """Parameters of the fullest of ``pp`` pipeline stages (``rank_params``); ``param_counts(cfg).total`` at ``pp``
    1."""
    return rank_params(cfg, pp=pp)[0]


def routed_expert_params(cfg: ModelShape) -> int:
    """Parameters of the routed experts of every layer (0 when dense): what expert parallelism splits."""
    experts = moe_experts(cfg)
    return cfg.n_layer * experts * mlp_params(cfg, expert_width(cfg)) if experts else 0


def _norm_params(cfg: ModelShape) -> int:
    return cfg.d_model * (2 if cfg.arch == "gpt2" and uses_bias(cfg) else 1)  # RMSNorm has no bias


def tensor_parallel_split_problem(cfg: ModelShape, tp: int, sequence_parallel: bool) -> str | None:
    """Why ``tp`` ranks cannot split ``cfg``'s layers evenly (``lab.parallel.axes.tensor``), or None when they can."""
    if tp == 1:
        return None
    kv = kv_heads(cfg)
    checks = [(cfg.n_head, "model.n_head"), (ffn_width(cfg), "the MLP width (model.d_ff)")]
    if kv >= tp:
        checks.append((kv, "model.n_kv_head (or be a multiple of it: then the key/value heads are replicated)"))
    elif tp % kv:
        return f"model.n_kv_head ({kv}) must divide parallel.tp ({tp}) to replicate the key/value heads"
    if sequence_parallel:
        checks.append((cfg.block_size, "model.block_size (sequence parallel splits the sequence)"))
    if cfg.vocab_size is not None:
        checks.append((padded_vocab(cfg), f"the embedding's rows (set model.pad_vocab_to to a multiple of {tp})"))
    return next((f"parallel.tp ({tp}) must divide {what}, which is {size}" for size, what in checks if size % tp),
                None)


def tensor_parallel_params(cfg: ModelShape, tp: int) -> int:
    """Parameters each rank of a tensor-parallel group of ``tp`` holds (``lab.parallel.axes.tensor``; ``rank_params``):
    ``param_counts`` at ``tp`` 1."""
    return int(rank_params(cfg, tp=tp)[0])


# ---------------------------------------------------------------- FLOPs


def flops_per_token(cfg: ModelShape) -> float:
    """Training FLOPs per token: 6·N_matmul + 12·L·d_attn·T (forward + backward, PaLM appendix B).

    N_matmul counts the weights used in matmuls (blocks and output head, not embedding lookups);
    the second term is the attention score and value products, counted over the full context.
    In a mixture of experts N_matmul is the active path: the router, the top_k routed experts and the
    shared ones (``ParamCounts.active_matmul``); MFU on these FLOPs is MFU on active FLOPs. The
    softmax, top-k and the gate multiply are left out (O(E + d) per token).
    """
    n = param_counts(cfg).active_matmul
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_head * head_dim(cfg) * cfg.block_size


def training_flops(params: float, tokens: float) -> float:
    """The C = 6·N·D approximation."""
    return 6.0 * params * tokens


# ---------------------------------------------------------------- memory: model states

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PRECISIONS = ("mixed", "fp32")

# Bytes per parameter of (weights, gradients, optimizer states) held by a rank before sharding.
# mixed: 16-bit weights and gradients, fp32 master weights + two AdamW moments (K = 12);
# fp32: 4-byte weights and gradients, the two moments (K = 8).
_STATE_WIDTHS: dict[str, tuple[int, int, int]] = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}
# Which of (weights, gradients, optimizer states) each strategy shards over the data-parallel ranks.
_SHARDED: dict[str, tuple[bool, bool, bool]] = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
}


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds, by kind; with ``offload`` the optimizer states sit in host memory."""

    params: float
    grads: float
    optimizer: float
    offload: bool = False

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def gpu(self) -> float:
        """Bytes on the accelerator (everything but offloaded optimizer states)."""
        return self.params + self.grads + (0.0 if self.offload else self.optimizer)

    @property
    def cpu(self) -> float:
        """Bytes in host memory (the optimizer states, when offloaded)."""
        return self.optimizer if self.offload else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def model_state_bytes(params: float, strategy: str, n_devices: int = 1, precision: str = "mixed",
                      offload: bool = False, one_moment: float = 0.0) -> StateBytes:
    """Per-rank bytes of weights, gradients and AdamW states for Ψ = ``params`` over N_d = ``n_devices``.

    ZeRO (Rajbhandari et al. 2019, §5), mixed precision, K = 12 (fp32 master weights + two moments):
    ddp (2 + 2 + K)·Ψ; zero1 2Ψ + 2Ψ + K·Ψ/N_d; zero2 2Ψ + (2 + K)·Ψ/N_d; zero3 (2 + 2 + K)·Ψ/N_d.
    ``precision="fp32"`` keeps the structure with 4-byte weights and gradients and K = 8, so fp32 ddp
    is the naive 4 + 4 + 8 = 16 B/param (the lab's own runs: fp32 weights, bf16 only inside
    autocast). ``offload`` moves the optimizer states (and the update) to host memory as in
    ZeRO-Offload (Ren et al. 2021), sharded as the strategy shards them; in fp32 training that adds
    a 4-byte fp32 master copy of the weights beside the moments (mixed precision's K = 12 already
    holds one), since the update no longer runs where the weights live. ``one_moment`` of the ``params`` keep one
    fp32 moment instead of two (Muon's momentum: 4 bytes fewer each). Activations,
    communication buckets and allocator slack are not included.
    """
    if strategy not in _SHARDED:
        raise ValueError(f"unknown strategy '{strategy}' (known: {', '.join(STRATEGIES)})")
    if precision not in _STATE_WIDTHS:
        raise ValueError(f"unknown precision '{precision}' (known: {', '.join(PRECISIONS)})")
    if params < 0 or n_devices < 1:
        raise ValueError("need params >= 0 and n_devices >= 1")
    widths = list(_STATE_WIDTHS[precision])
    if offload and precision == "fp32":
        widths[2] += 4  # the host's master copy of the weights
    weights, grads, optim = (count * width / (n_devices if sharded else 1) for width, sharded, count
                             in zip(widths, _SHARDED[strategy], (params, params, params - one_moment)))
    optim += one_moment * (widths[2] - 4) / (n_devices if _SHARDED[strategy][2] else 1)
    return StateBytes(params=weights, grads=grads, optimizer=optim, offload=offload)


# ---------------------------------------------------------------- communication

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def ring_elements_sent(collective: str, elements: float, n_ranks: int) -> float:
    """Elements one rank sends in a ring implementation of ``collective`` over ``n_ranks``.

    ``elements`` is the full tensor: the all-reduced tensor, the input of a reduce-scatter (all
    shards), the output of an all-gather, the broadcast tensor. A reduce-scatter or an all-gather
    sends (N − 1)/N of it per rank, an all-reduce (= reduce-scatter + all-gather) 2(N − 1)/N, a
    pipelined broadcast (N − 1)/N on average. One rank sends nothing.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective '{collective}' (known: {', '.join(COLLECTIVES)})")
    if n_ranks < 1:
        raise ValueError("need n_ranks >= 1")
    share = (n_ranks - 1) / n_ranks
    return (2 * share if collective == "all_reduce" else share) * elements


# How many times each strategy moves the Ψ gradient or parameter elements per step, by collective.
_TRAFFIC: dict[str, dict[str, int]] = {
    "ddp": {"all_reduce": 1},  # the gradients
    "zero1": {"reduce_scatter": 1, "all_gather": 1},  # gradients in, updated weights out
    "zero2": {"reduce_scatter": 1, "all_gather": 1},
    "zero3": {"reduce_scatter": 1, "all_gather": 2},  # weights gathered for the forward and again for the backward
}


def comm_bytes_per_step(params: float, strategy: str, n_devices: int, bytes_per_element: float = 4.0,
                        gather_bytes_per_element: float | None = None) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective, for Ψ = ``params`` over N_d ranks.

    Rajbhandari et al. 2019 §7 with the ring's rank count kept: ddp all-reduces the gradients,
    2(N_d − 1)/N_d·Ψ; zero1 and zero2 reduce-scatter the gradients and all-gather the updated
    weights, the same 2(N_d − 1)/N_d·Ψ; zero3 all-gathers the weights twice (forward, backward) and
    reduce-scatters the gradients, 3(N_d − 1)/N_d·Ψ. Gradients are ``bytes_per_element`` wide (the reduce dtype:
    4 in fp32, 2 under mixed precision), the gathered weights ``gather_bytes_per_element`` (by default the same).
    """
    if strategy not in _TRAFFIC:
        raise ValueError(f"unknown strategy '{strategy}' (known: {', '.join(STRATEGIES)})")
    if n_devices < 1:
        raise ValueError("need n_devices >= 1")
    out = dict.fromkeys(COLLECTIVES, 0.0)
    for collective, times in _TRAFFIC[strategy].items():
        width = gather_bytes_per_element if collective == "all_gather" and gather_bytes_per_element else \
            bytes_per_element
        out[collective] = times * ring_elements_sent(collective, params, n_devices) * width
    return out


def expert_all_to_all_bytes(cfg: ModelShape, tokens: int, ep: int, forwards: int = 1,
                            bytes_per_element: float = 4.0, layers: int | None = None) -> float:
    """Bytes one rank of an expert-parallel group of ``ep`` sends through its all-to-alls in one micro-step of
    ``tokens`` tokens, in theory: at balanced routing, dropless. Each MoE layer's forward sends the k·N assignments'
    rows (d elements each) to their experts' ranks, (P − 1)/P of them to other ranks, and sends back as many outputs,
    after the E/P·(P − 1) 8-byte row counts; the backward sends the gradients of both exchanges, and activation
    checkpointing runs the forward ``forwards`` times. ``layers``: the MoE layers the rank runs (under a pipeline, its
    stages'; by default every one)."""
    share = (ep - 1) / ep
    rows = 2 * tokens * cfg.moe_top_k * share * cfg.d_model * bytes_per_element
    counts = moe_experts(cfg) * share * 8
    return (cfg.n_layer if layers is None else layers) * (forwards * (rows + counts) + rows)


def comm_elements_per_step(params: float, strategy: str, n_devices: int) -> float:
    """Elements each rank sends per step: 2(N_d − 1)/N_d·Ψ for ddp, zero1, zero2; 3(N_d − 1)/N_d·Ψ for zero3."""
    return sum(comm_bytes_per_step(params, strategy, n_devices, bytes_per_element=1.0).values())


def tensor_parallel_comm_bytes(cfg: ModelShape, micro_batch: int, accum_steps: int, tp: int,
                               sequence_parallel: bool = False, bytes_per_element: float = 4.0,
                               layers: TensorLayers | None = None) -> dict[str, float]:
    """Bytes each rank sends per optimizer step over its tensor-parallel group of ``tp`` ranks, by collective.

    Per micro-step of b sequences of s tokens, width h (Megatron-LM): every row-parallel layer all-reduces its
    output, b·s·h, forward (attention output, MLP down) and every column-parallel layer its input's gradient
    backward (QKV, MLP up): four per dense block, two per mixture-of-experts block (its MLP is not split); the
    vocabulary-parallel embedding once forward and the head's input once backward; the loss three times b·s (row
    max, sum of exponentials, target logit). With sequence parallelism each all-reduce of b·s·h becomes an
    all-gather and a reduce-scatter (the same bytes), and the gradients of the whole weights that act on sequence
    shards (norms, the row-parallel biases, learned positions) are all-reduced once per micro-step; activations and
    gradients ``bytes_per_element`` wide (2 under mixed precision), the loss's figures fp32. With fewer
    key/value heads than ``tp`` (GQA, replicated), each block's key and value rows' gradients are all-reduced once
    per backward, every part in its own slot (``n_kv_head`` slots of one head's rows). ``layers`` says what this
    rank holds and runs (a pipeline stage's share; by default the whole model).
    """
    out = dict.fromkeys(COLLECTIVES, 0.0)
    if tp == 1:
        return out
    dense = 0 if moe_experts(cfg) else cfg.n_layer
    held = layers or TensorLayers(cfg.n_layer + dense, cfg.n_layer + dense, cfg.n_layer, True, True, 1)
    tokens = micro_batch * cfg.block_size * held.token_share
    activations = tokens * cfg.d_model
    big = (held.column + held.row + held.embeds + held.head) * activations  # elements all-reduced (or gathered...)
    # the loss's three figures are fp32 whatever the activations' width: counted at 4 bytes
    loss = ring_elements_sent("all_reduce", 3 * tokens, tp) * 4 / bytes_per_element if held.head else 0.0
    out["all_reduce"] = loss
    if kv_heads(cfg) < tp:
        replicated = held.attention * 2 * kv_heads(cfg) * head_dim(cfg) * (cfg.d_model + (1 if uses_bias(cfg) else 0))
        out["all_reduce"] += held.backwards * ring_elements_sent("all_reduce", replicated, tp)
    if sequence_parallel:
        norms = 2 * cfg.n_layer + 1
        on_shards = norms * cfg.d_model * (2 if _norm_has_bias(cfg) else 1)
        on_shards += 2 * cfg.n_layer * cfg.d_model if uses_bias(cfg) else 0
        on_shards += cfg.block_size * cfg.d_model if cfg.arch == "gpt2" else 0
        out["all_reduce"] += ring_elements_sent("all_reduce", on_shards, tp)
        out["all_gather"] = ring_elements_sent("all_gather", big, tp)
        out["reduce_scatter"] = ring_elements_sent("reduce_scatter", big, tp)
    else:
        out["all_reduce"] += ring_elements_sent("all_reduce", big, tp)
    return {k: v * accum_steps * bytes_per_element for k, v in out.items()}


@dataclass(frozen=True)
class TensorLayers:
    """What one rank of a tensor-parallel group holds and runs: column- and row-parallel layers, attention layers (the
    key/value rows), whether it runs the embedding and the head (a pipeline's first and last stage), backwards per
    micro-step (a pipeline's microbatches) and the share of each sequence's tokens (a context-parallel shard's)."""

    column: int
    row: int
    attention: int
    embeds: bool
    head: bool
    backwards: int
    token_share: float = 1.0


def _norm_has_bias(cfg: ModelShape) -> bool:
    """LayerNorm with a bias (gpt2 with biases); RMSNorm has none."""
    return cfg.arch == "gpt2" and uses_bias(cfg)


# ---------------------------------------------------------------- memory: activations


def activation_bytes(cfg: ModelShape, micro_batch: int, bytes_per_act: int = 2, checkpointing: bool = False,
                     flash: bool = True, tp: int = 1, sequence_parallel: bool = False, cp: int = 1) -> float:
    """Bytes of activations one rank keeps for the backward pass of one micro-batch: an estimate.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4),
    with s = block_size, b = micro_batch, h = d_model, a = n_head, L = n_layer, V = padded vocab,
    16-bit activations, no tensor or sequence parallelism: each layer stores s·b·h·(34 + 5·a·s/h)
    bytes. Of the 34, 32 are 16 values per token and channel (norm inputs, Q, K, V, attention
    output, 4h MLP input and GELU output, …) and 2 are one-byte dropout masks; the 5·a·s/h term is
    the a×s×s softmax output, its dropout output and mask. With ``bytes_per_act`` = p the layer
    stores s·b·h·(16·p + 2) + a·s²·b·(2·p + 1). A fused (flash) attention kernel, as with this
    project's ``scaled_dot_product_attention``, never stores the s×s matrices, so the default drops
    that term. Full activation checkpointing keeps each layer's input (p·s·b·h) plus one layer's
    full activations while it is recomputed. The fp32 logits for the loss add 4·s·b·V.

    Tensor parallelism over ``tp`` ranks (``lab.parallel.axes.tensor``) splits the 12 values inside attention
    and the MLP (Q, K, V, attention output, the MLP's 4h and 4h), the s×s term and the logits tp ways;
    the norms' inputs, the two column-parallel inputs and the masks stay whole (s·b·h·(4·p + 2 + 12·p/tp),
    Korthikanti's 10 + 24/t). Sequence parallelism also splits the norms' inputs, the masks and the
    checkpointed layer inputs; the column-parallel layers keep the input they were given, gathered whole
    (s·b·h·(2·p + (14·p + 2)/tp); Megatron-LM keeps the shard and gathers it again in the backward: 34/t).

    Context parallelism over ``cp`` ranks (``lab.parallel.axes.context``) gives each rank s/cp of every
    sequence's tokens: every term is a token's, so each falls cp-fold (the ring's key/value blocks in flight
    are transient: ``activation_peak_bytes``).

    Assumptions: GPT-2-style blocks (GELU MLP of width 4h, full multi-head attention, dropout masks
    counted even at dropout 0); SwiGLU, GQA or another d_ff shift the count somewhat. Embedding
    output, final norm, temporaries and the allocator's slack are left out.
    """
    if micro_batch <= 0 or bytes_per_act <= 0 or tp <= 0:
        raise ValueError("need micro_batch > 0, bytes_per_act > 0 and tp > 0")
    s, b, h, a, p = cfg.block_size, micro_batch, cfg.d_model, cfg.n_head, bytes_per_act
    on_shards = tp if sequence_parallel else 1  # what the sequence shards hold: norms' inputs, masks, layer inputs
    layer = s * b * h * (2 * p + (2 * p + 2) / on_shards + 12 * p / tp)
    if not flash:
        layer += a * s * s * b * (2 * p + 1) / tp
    kept = cfg.n_layer * p * s * b * h / on_shards + layer if checkpointing else cfg.n_layer * layer
    return float(kept + 4 * s * b * padded_vocab(cfg) / tp) / cp


def activation_peak_bytes(cfg: ModelShape, micro_batch: int, bytes_per_act: int = 4, tp: int = 1, cp: int = 1
                          ) -> float:
    """The most activation bytes one rank holds during a step's forward and backward, an estimate: what the layers
    keep for the backward (``activation_bytes``), the final norm's input and output (2·p·s·b·h), and at the backward's
    start the loss's gradient beside the log-softmax it saved (4·s·b·V fp32); under context parallelism cp-fold
    less, plus the ring's two key/value blocks in flight (a received one and the next; 2·2·kv·d_head·p per token of
    a shard)."""
    s, b, h = cfg.block_size, micro_batch, cfg.d_model
    extra = 2 * bytes_per_act * s * b * h / tp + 4 * s * b * padded_vocab(cfg) / tp
    ring = 4 * kv_heads(cfg) * head_dim(cfg) * bytes_per_act * s * b / tp if cp > 1 else 0.0
    return activation_bytes(cfg, micro_batch, bytes_per_act, tp=tp, cp=cp) + (extra + ring) / cp


def autocast_weight_bytes(cfg: ModelShape, tp: int = 1) -> float:
    """Bytes of the bf16 copies bf16 autocast makes of the matmul weights in the forward: 2 per weight (every
    expert's; split ``tp`` ways). Autocast caches each cast for the forward and the matmuls save them for the
    backward, so all of them are held at the forward's end, beside the fp32 weights."""
    return 2.0 * param_counts(cfg).matmul / tp


def newton_schulz_flops(shape: Sequence[int], steps: int) -> int:
    """FLOPs of Muon's orthogonalization (``lab.training.muon.newton_schulz``) of a matrix of ``shape``: per
    iteration XXᵀ (2m²n), A² (2m³) and the product with X (2m²n), m ≤ n."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)
