"""What a dp × tp × pp layout costs, on paper: memory per GPU, bytes per axis and a step's time.

A step of B tokens runs on n = pp · dp · cp · tp GPUs. Each data-parallel replica runs m = B / (dp · b · s)
micro-batches of b sequences of s tokens through pp stages of L / pp blocks (1F1B), and each block is split
tp ways (Megatron-LM's tensor parallelism with sequence parallelism). pp is the outermost axis and tp the
innermost, as the lab's mesh orders them (``lab.parallel.layout.AXES``): tp stays within a node, a data-parallel
group spans nodes when tp · dp GPUs fill more than one, and a stage's neighbour sits n / pp GPUs away.

Time, a model and not a measurement (every term is printed beside the total):
- compute: FLOPs per token (``accounting.flops_per_token``) × B / n at the GPU's dense peak × ``mfu``;
- bubble: (p − 1) / m of the compute, 1F1B's and GPipe's idle time (Narayanan et al. 2021);
- tensor parallelism: its collectives (``accounting.tensor_parallel_comm_bytes``) on the critical path;
- pipeline: b · s · h activations forward and as many gradient values back per micro-batch and boundary;
- context parallelism (``cp``, inside a node beside tp): each rank runs s/cp of every sequence's tokens, and
  sends (3cp − 2) key/value blocks of b · s/cp · 2 · kv_heads · d_head per layer and micro-batch around the ring
  (the lab's ring attention: cp − 1 forward, 2cp − 1 backward), on the critical path;
- data parallelism: the stage's collectives over dp (zero3 gathers the weights again each micro-batch, as
  the lab's does), overlapped with the backward (2/3 of the compute): only what exceeds it counts.
Bytes are bf16 (2 per value); links run at ``intra`` bytes/s within a node and ``inter`` between nodes.

Memory per GPU, the fullest stage (``accounting.rank_params``, the share the lab's runs hold): its blocks plus the
embedding (first stage) or the final norm and the head (last; a tied head is a second copy of the embedding), split
tp ways, as model states under
the ZeRO stage over dp (``accounting.model_state_bytes``, 16 B per parameter in mixed precision); and its
activations (``accounting.activation_bytes``): 1F1B keeps min(pp, m) micro-batches in flight on the first
stage, one (with its logits) on the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lab.measure import accounting, hardware
from lab.measure.accounting import ModelShape

BYTES_PER_VALUE = 2.0  # bf16 activations, gradients and weights on the wire
BACKWARD_SHARE = 2 / 3  # of a step's compute: the window data-parallel traffic overlaps


@dataclass(frozen=True)
class Cluster:
    """GPUs, their count and links; ``memory`` is what a GPU may fill (bytes)."""

    gpu: str
    n_gpus: int
    gpus_per_node: int
    memory: float
    intra: float  # bytes/s one GPU sends within a node
    inter: float  # bytes/s one GPU sends to another node
    mfu: float


@dataclass(frozen=True)
class LayoutCost:
    """One dp × cp × tp × pp layout and data-parallel stage, with its costs (seconds per step, bytes per GPU)."""

    pp: int
    dp: int
    tp: int
    stage: str
    microbatches: int
    states: float
    activations: float
    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    dp_exposed_s: float
    fits: bool
    cp: int = 1
    cp_s: float = 0.0  # the ring's key/value traffic, on the critical path

    @property
    def memory(self) -> float:
        return self.states + self.activations

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.cp_s + self.pp_s + self.dp_exposed_s

    @property
    def name(self) -> str:
        return f"tp {self.tp} × {f'cp {self.cp} × ' if self.cp > 1 else ''}pp {self.pp} × dp {self.dp}"

    def terms(self, cp: bool = True) -> dict[str, float]:
        """The step's seconds by cause (the ring's, ``cp``, where context parallelism is priced)."""
        return {"compute": self.compute_s, "bubble": self.bubble_s, "tp": self.tp_s,
                **({"cp": self.cp_s} if cp else {}), "pp": self.pp_s, "dp exposed": self.dp_exposed_s}


def cost(cfg: ModelShape, tp: int, pp: int, stage: str, micro_batch: int, batch_tokens: float, cluster: Cluster,
         checkpointing: bool = False, cp: int = 1) -> LayoutCost:
    """The costs of one layout (tp must split the model, pp divide its layers and tp · cp · pp the GPUs)."""
    dp = cluster.n_gpus // (tp * pp * cp)
    s, h = cfg.block_size, cfg.d_model
    m = max(1, math.ceil(batch_tokens / (dp * micro_batch * s)))
    tokens = m * dp * micro_batch * s  # the step actually run (B rounded up to whole micro-batches)
    compute = accounting.flops_per_token(cfg) * tokens / cluster.n_gpus / (
        hardware.gpu_peak_flops(cluster.gpu) * cluster.mfu)
    sp = tp > 1
    tp_bytes = sum(accounting.tensor_parallel_comm_bytes(cfg, micro_batch, m, tp, sp, BYTES_PER_VALUE).values()) / pp
    tp_bytes /= cp  # a context shard's tokens
    boundary = micro_batch * s * h * BYTES_PER_VALUE / cp
    pp_bytes = 0.0 if pp == 1 else 2 * m * boundary  # a middle stage: activations on, gradients back
    pp_link = cluster.inter if cluster.n_gpus // pp >= cluster.gpus_per_node else cluster.intra
    dp_link = cluster.inter if tp * cp * dp > cluster.gpus_per_node else cluster.intra
    # the ring: per layer and micro-batch, (cp − 1) key/value blocks forward, (2cp − 1) backward (blocks and gradients)
    block = micro_batch * s / cp * 2 * accounting.kv_heads(cfg) // tp * accounting.head_dim(cfg) * BYTES_PER_VALUE
    cp_bytes = 0.0 if cp == 1 else m * cfg.n_layer / pp * (3 * cp - 2) * block
    cp_link = cluster.intra if tp * cp <= cluster.gpus_per_node else cluster.inter
    params = accounting.rank_params(cfg, tp, pp)[0]  # the fullest stage's share of one rank (the lab's own split)
    sent = accounting.comm_bytes_per_step(params, stage, dp * cp, BYTES_PER_VALUE)
    dp_bytes = sum(sent.values()) + (m - 1) * sent["all_gather"] * (stage == "zero3")
    dp_s = dp_bytes / dp_link
    layers = accounting.activation_bytes(replace(cfg, n_layer=cfg.n_layer // pp), micro_batch,
                                         checkpointing=checkpointing, tp=tp, sequence_parallel=sp, cp=cp)
    logits = 4 * s * micro_batch * accounting.padded_vocab(cfg) / tp / cp
    in_flight = min(pp, m)
    activations = max(in_flight * (layers - logits), layers) if pp > 1 else layers
    states = accounting.model_state_bytes(params, stage, dp, "mixed").gpu
    return LayoutCost(pp=pp, dp=dp, tp=tp, stage=stage, microbatches=m, states=states, activations=activations,
                  compute_s=compute, bubble_s=compute * (pp - 1) / m, tp_s=tp_bytes / cluster.intra,
                  pp_s=pp_bytes / pp_link, dp_s=dp_s, dp_exposed_s=max(0.0, dp_s - BACKWARD_SHARE * compute),
                  fits=states + activations <= cluster.memory, cp=cp, cp_s=cp_bytes / cp_link)


def layouts(cfg: ModelShape, micro_batch: int, batch_tokens: float, cluster: Cluster, checkpointing: bool = False,
            max_cp: int = 1) -> tuple[list[LayoutCost], list[str]]:
    """Every layout of the model on the cluster, each stage: tp a divisor of the GPUs within a node that splits
    the heads and the MLP, cp up to ``max_cp`` that fits in the node beside it and cuts the sequence into 2·cp chunks
    (the lab's balanced split), pp one of the rest that divides the layers; and why each other tp cannot be."""
    rows, refused = [], []
    for tp in (t for t in range(1, min(cluster.n_gpus, cluster.gpus_per_node) + 1) if cluster.n_gpus % t == 0):
        shape = replace(cfg, pad_vocab_to=math.lcm(cfg.pad_vocab_to, tp))
        problem = accounting.tensor_parallel_split_problem(shape, tp, sequence_parallel=tp > 1)
        if problem is not None:
            refused.append(f"tp {tp}: {problem}")
            continue
        for cp in (c for c in range(1, min(max_cp, cluster.gpus_per_node // tp) + 1)
                   if (cluster.n_gpus // tp) % c == 0 and cfg.block_size % (2 * c) == 0):
            for pp in (p for p in range(1, cfg.n_layer + 1)
                       if cfg.n_layer % p == 0 and (cluster.n_gpus // (tp * cp)) % p == 0):
                rows += [cost(shape, tp, pp, stage, micro_batch, batch_tokens, cluster, checkpointing, cp)
                         for stage in accounting.STRATEGIES]
    return rows, refused


def choose(rows: list[LayoutCost]) -> LayoutCost | None:
    """The fastest layout that fits; ties go to less tensor parallelism, then less context parallelism, then fewer
    stages, then the lower stage."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: (round(r.step_s, 9), r.tp, r.cp, r.pp, accounting.STRATEGIES.index(r.stage)),
               default=None)
