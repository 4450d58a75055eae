"""A run's plan, resolved once at the start of every entry point, and every refusal of a run's configuration.

``plan_run`` turns a run's configuration and world size into a ``RunPlan``: the layout (every axis's degree and the
strategy's class), the step plan and the loop's settings, and the precision policy once the device is known. Each
check is made here, in one line, before any rank starts: the counts and the schedule, the model's split over the
axes, the [parallel] options and their combinations, the precision policy and what the loop asks of the strategy.
Nothing downstream derives the layout again or checks again: the engine is made from the plan
(``lab.parallel.create``), the loop reads its data replicas and steps from it. Entry points that train layouts without
a run (the matrix, equivalence, the benchmarks) check theirs with ``check_layout``, and ``create`` makes an engine
from a checked layout in one call.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab import parallel
from lab.measure import accounting
from lab.measure.device import Precision
from lab.model import validate as check_model_config
from lab.parallel import Engine, Layout, LoopSettings, World, strategy_class
from lab.parallel.layout import OPTIONS as LAYOUT_OPTIONS
from lab.parallel.axes import activations, context, pipeline, tensor
from lab.parallel.data.deepspeed import ZERO_STAGES, DeepSpeed, engine_config, import_deepspeed
from lab.runtime import compat
from lab.runtime.config import NONFINITE, OPTIMIZERS, ConfigError, ModelConfig, ParallelConfig, RunConfig, did_you_mean
from lab.training import expect, schedule, trackers
from lab.training.muon import parse_coefficients
from lab.training.steps import StepPlan, checkpoint_steps, loop_settings


@dataclass(frozen=True)
class RunPlan:
    """A run's configuration resolved for ``layout.world_size`` processes."""

    cfg: RunConfig
    layout: Layout
    steps: StepPlan
    loop: LoopSettings
    precision: Precision | None = None  # once the device is known


def plan_run(cfg: RunConfig, world_size: int, precision: Precision | None = None,
            vocab_size: int | None = None) -> RunPlan:
    """Every check of ``cfg`` that needs neither data nor hardware (``precision``, when given, is checked too;
    ``vocab_size``: the tokenizer's, for a model that takes it from the data); ConfigError with one line.

    The degrees, the model's split and the [parallel] section are checked before the batch: a batch that does not
    divide is often the consequence of a strategy, degree or world size that is itself the mistake, and that one is
    named.
    """
    check_model_config(cfg.model)
    schedule.validate(cfg.train)
    check_counts(cfg)
    check_degrees(cfg.parallel, world_size)
    layout = Layout.of(cfg.parallel, world_size, strategy_class(cfg.parallel.strategy))  # the run's one layout
    steps = split_batch(cfg, layout.dp)
    loop = loop_settings(cfg, steps)
    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size)
    check_layout(cfg.parallel, world_size, loop, model, precision, layout)
    check_batch(cfg, steps, world_size)
    check_train(cfg, steps)
    return RunPlan(cfg, layout, steps, loop, precision)


def create(cfg: ParallelConfig, world: World, precision: Precision, loop: LoopSettings,
           model: ModelConfig | None = None) -> Engine | DeepSpeed:
    """The engine of ``cfg`` on ``world``, its layout checked first (``check_layout``): an entry point's one call."""
    return parallel.create(cfg, check_layout(cfg, world.world_size, loop, model, precision), world, precision, loop)


# ---------------------------------------------------------------- the steps


def check_counts(cfg: RunConfig) -> None:
    """Raise ConfigError (one line) for a count of tokens, sequences or steps that is not positive."""
    t = cfg.train
    for name in ("tokens", "batch_tokens", "micro_batch", "log_every", "eval_tokens"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")


def split_batch(cfg: RunConfig, replicas: int) -> StepPlan:
    """The plan over ``replicas`` data-parallel replicas, its accumulation steps rounded down (at least 1) where the
    batch does not divide (``check_batch``)."""
    t, T = cfg.train, cfg.model.block_size
    return StepPlan(global_sequences=t.batch_tokens // T,
                    accum_steps=max(1, t.batch_tokens // (t.micro_batch * T * replicas)),
                    total_steps=math.ceil(t.tokens / t.batch_tokens), micro_batch=t.micro_batch, world_size=replicas)


def check_batch(cfg: RunConfig, plan: StepPlan, world_size: int) -> None:
    """Raise ConfigError (one line) when the global batch is not a whole number of micro-batches on every replica,
    naming the option that fixes it: the largest smaller micro-batch that divides, else the batch."""
    batch, micro, T, replicas = cfg.train.batch_tokens, plan.micro_batch, cfg.model.block_size, plan.world_size
    if batch % (micro * T * replicas) == 0:
        return
    label = "ranks" if replicas == world_size else "data-parallel replicas"
    largest = min(micro - 1, batch // (T * replicas))  # a larger micro-batch than the batch never divides it
    fits = [m for m in range(largest, 0, -1) if batch % (m * T * replicas) == 0]
    fix = (f"set --train.micro_batch {fits[0]}" if fits else
           f"set --train.batch_tokens to a multiple of {T * replicas} (block_size × {label})")
    raise ConfigError(f"train.batch_tokens ({batch}) is not a multiple of train.micro_batch × model.block_size × "
                      f"{label} ({micro} × {T} × {replicas} = {micro * T * replicas}): {fix}")


def check_train(cfg: RunConfig, plan: StepPlan) -> None:
    """Raise ConfigError (one line) for a [train] or [log] option that cannot run."""
    checkpoint_steps(cfg, plan.total_steps)
    trackers.validate(cfg.log)
    if cfg.train.memory_meter and cfg.train.compile:
        raise ConfigError("train.memory_meter cannot run with train.compile (dynamo does not trace the meter's "
                          "dispatch mode); set one of them false")
    if cfg.train.nonfinite not in NONFINITE:
        raise ConfigError(f"train.nonfinite must be one of {', '.join(NONFINITE)}, got '{cfg.train.nonfinite}'"
                          f"{did_you_mean(cfg.train.nonfinite, NONFINITE)}")
    check_optimizer(cfg)
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg.train, name) < 1:
            raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(cfg.train, name)}")
    for name in ("stop_after", "checkpoint_every", "eval_every", "keep_checkpoints", "seed", "grad_clip",
                 "memory_budget", "weight_decay", "peak_flops"):
        if (getattr(cfg.train, name) or 0) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(cfg.train, name)}")
    if cfg.train.expect:  # a law that cannot be read is refused before any work
        try:
            expect.read_law(cfg.train.expect)
        except expect.LawError as e:
            raise ConfigError(f"train.expect: {e}") from None


def check_optimizer(cfg: RunConfig) -> None:
    """Raise ConfigError (one line) for a train.optimizer or Muon option that cannot run."""
    t = cfg.train
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got '{t.optimizer}'"
                          f"{did_you_mean(t.optimizer, OPTIMIZERS)}")
    if not 0 <= t.muon_momentum < 1:
        raise ConfigError(f"train.muon_momentum must be in [0, 1), got {t.muon_momentum}")
    if not 1 <= t.muon_ns_steps < 100:
        raise ConfigError(f"train.muon_ns_steps must be in 1..99, got {t.muon_ns_steps}")
    parse_coefficients(t.muon_ns_coefficients)


# ---------------------------------------------------------------- the layout


def check_layout(cfg: ParallelConfig, world_size: int, loop: LoopSettings, model: ModelConfig | None = None,
                 precision: Precision | None = None, layout: Layout | None = None) -> Layout:
    """The layout ``cfg`` asks for on ``world_size`` processes under the loop's ``loop`` settings, every refusal of the
    [parallel] section made: its degrees, each axis's options, the strategy's and their combinations (every refusal of
    the matrix), and, given them, the model's split (``check_model``) and the precision policy (``check_precision``).
    ``layout``: the one the caller built already (``plan_run``), checked rather than built again.
    """
    compat.check()
    cls = strategy_class(cfg.strategy)
    check_degrees(cfg, world_size)
    if model is not None:
        check_model(cfg, model)
    layout = layout or Layout.of(cfg, world_size, cls)
    if cfg.tp_impl not in tensor.IMPLEMENTATIONS:
        raise ConfigError(f"parallel.tp_impl must be one of {', '.join(tensor.IMPLEMENTATIONS)}, got '{cfg.tp_impl}'"
                          f"{did_you_mean(cfg.tp_impl, tensor.IMPLEMENTATIONS)}")
    if cfg.tp_impl == "torch" and cfg.tp == 1:
        raise ConfigError("parallel.tp_impl torch (the DTensor reference) needs parallel.tp > 1")
    check_pipeline(cfg, loop.micro_batch)
    check_context(cfg)
    if not cfg.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {cfg.timeout_s}")
    if not cfg.bucket_mb > 0:
        raise ConfigError(f"parallel.bucket_mb must be positive, got {cfg.bucket_mb}")
    for option, allowed in (("activation_checkpointing", activations.MODES), ("offload", cls.offload_modes)):
        if (value := getattr(cfg, option)) not in allowed:
            raise ConfigError(f"parallel.{option} must be one of {', '.join(allowed)}, got '{value}'"
                              f"{did_you_mean(value, allowed)}")
    for option in changed_options(cfg):
        if option not in cls.options | LAYOUT_OPTIONS:
            users = [name for name, c in parallel.STRATEGIES.items() if option in c.options]
            raise ConfigError(f"parallel.{option} has no effect under strategy '{cls.name}' "
                              f"(it applies to: {', '.join(users) or 'no strategy'})")
    check_combination(layout, cfg, cls, loop)
    check_strategy(cfg, cls, layout.dp * layout.cp, loop)
    if precision is not None:
        check_precision(cfg, precision)
    return layout


def changed_options(cfg: ParallelConfig) -> list[str]:
    """The [parallel] options set to something other than their default (strategy and timeout aside)."""
    default = ParallelConfig()
    return [f.name for f in dataclasses.fields(cfg) if f.name not in ("strategy", "timeout_s")
            and getattr(cfg, f.name) != getattr(default, f.name)]


def check_degrees(cfg: ParallelConfig, world_size: int) -> None:
    """Raise ConfigError (one line) when the degrees cannot split ``world_size`` ranks."""
    for axis, degree in (("tp", cfg.tp), ("pp", cfg.pp), ("ep", cfg.ep), ("cp", cfg.cp)):
        if degree < 1:
            raise ConfigError(f"parallel.{axis} must be at least 1, got {degree}")
    if world_size % cfg.tp:
        raise ConfigError(f"parallel.tp ({cfg.tp}) must divide the world size ({world_size})")
    if world_size % (cfg.tp * cfg.pp):
        raise ConfigError(f"parallel.tp × parallel.pp ({cfg.tp} × {cfg.pp}) must divide the world size "
                          f"({world_size})")
    if world_size % (cfg.tp * cfg.pp * cfg.cp):
        raise ConfigError(f"parallel.tp × parallel.pp × parallel.cp ({cfg.tp} × {cfg.pp} × {cfg.cp}) must divide the "
                          f"world size ({world_size})")
    dp = world_size // (cfg.tp * cfg.pp * cfg.cp)
    if dp % cfg.ep:
        raise ConfigError(f"parallel.ep ({cfg.ep}) must divide the data-parallel ranks ({dp} = world size / "
                          f"(tp · pp))")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")


def check_pipeline(cfg: ParallelConfig, micro_batch: int) -> None:
    """Raise ConfigError (one line) when ``cfg``'s pipeline options cannot run with micro-steps of ``micro_batch``
    sequences."""
    if cfg.pp == 1:
        for option in ("pp_microbatches", "pp_schedule", "pp_virtual", "pp_impl"):
            if getattr(cfg, option) != getattr(ParallelConfig(), option):
                raise ConfigError(f"parallel.{option} has no effect with parallel.pp 1")
        return
    if cfg.pp_schedule not in pipeline.SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule must be one of {', '.join(pipeline.SCHEDULES)}, got "
                          f"'{cfg.pp_schedule}'{did_you_mean(cfg.pp_schedule, pipeline.SCHEDULES)}")
    if cfg.pp_impl not in pipeline.IMPLEMENTATIONS:
        raise ConfigError(f"parallel.pp_impl must be one of {', '.join(pipeline.IMPLEMENTATIONS)}, got "
                          f"'{cfg.pp_impl}'{did_you_mean(cfg.pp_impl, pipeline.IMPLEMENTATIONS)}")
    m = pipeline.microbatches(cfg)
    if m < 1:
        raise ConfigError(f"parallel.pp_microbatches must be at least 1, got {m}")
    if micro_batch % m:
        raise ConfigError(f"parallel.pp_microbatches ({m}) must divide train.micro_batch ({micro_batch})")
    if cfg.pp_schedule == "1f1b" and m < cfg.pp:
        raise ConfigError(f"parallel.pp_schedule 1f1b needs at least parallel.pp ({cfg.pp}) microbatches, got "
                          f"parallel.pp_microbatches {m} (use gpipe, or more microbatches)")
    if cfg.pp_virtual < 1:
        raise ConfigError(f"parallel.pp_virtual must be at least 1, got {cfg.pp_virtual}")
    if cfg.pp_virtual > 1 and cfg.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.pp_virtual {cfg.pp_virtual} needs parallel.pp_schedule interleaved")
    if cfg.pp_schedule == "interleaved" and m % cfg.pp:
        raise ConfigError(f"parallel.pp_schedule interleaved needs parallel.pp_microbatches a multiple of parallel.pp "
                          f"({cfg.pp}), got {m}: microbatches go round the stages in groups of pp")


def check_context(cfg: ParallelConfig) -> None:
    """Raise ConfigError (one line) for context-parallel options that cannot run."""
    if cfg.cp == 1:
        for option in ("cp_split", "cp_impl"):
            if getattr(cfg, option) != getattr(ParallelConfig(), option):
                raise ConfigError(f"parallel.{option} has no effect with parallel.cp 1")
        return
    for option, allowed in (("cp_split", context.SPLITS), ("cp_impl", context.IMPLEMENTATIONS)):
        if getattr(cfg, option) not in allowed:
            raise ConfigError(f"parallel.{option} must be one of {', '.join(allowed)}, got '{getattr(cfg, option)}'")


def check_combination(layout: Layout, cfg: ParallelConfig, strategy: type, loop: LoopSettings) -> None:
    """Raise ConfigError (one line) for axes, a strategy and loop settings that do not run together: every refusal
    of the matrix (data-parallel strategy × tp × pp × ep) is here."""
    split = [name for name in ("tp", "pp", "ep", "cp") if getattr(layout, name) > 1]
    if split and strategy.owns_step:
        raise ConfigError(f"strategy '{strategy.name}' does not run with parallel.{split[0]} > 1: "
                          f"{strategy.owns_step}")
    if layout.pp > 1 and cfg.pp_impl == "torch" and (strategy.name not in ("single", "ddp_naive") or layout.tp > 1):
        raise ConfigError("parallel.pp_impl torch runs under strategy single or ddp_naive without parallel.tp "
                          "only: its schedule runs every microbatch's backward inside one call, where the other "
                          "strategies' hooks (and the tensor split's) expect the lab's schedule")
    if layout.pp > 1 and cfg.pp_impl == "torch" and layout.ep > 1:
        raise ConfigError("parallel.pp_impl torch runs without parallel.ep: its stages carry no mixture of "
                          "experts' auxiliary losses; use pp_impl lab")
    if layout.pp > 1 and (cfg.sequence_parallel or cfg.tp_impl == "torch"):
        raise ConfigError("parallel.pp > 1 runs with the hand-rolled tensor parallelism without sequence "
                          "parallelism only, for now: stages send whole-sequence hidden states as plain tensors")
    if layout.ep > 1 and cfg.tp_impl == "torch":
        raise ConfigError("parallel.ep > 1 runs with the hand-rolled tensor parallelism only (tp_impl lab): the "
                          "DTensor reference splits no mixture of experts")
    if loop.compile and layout.pp > 1:
        raise ConfigError("train.compile with parallel.pp > 1 is not supported yet: a stage runs the model's "
                          "embed, run_blocks and output, not the compiled forward; set train.compile false")
    if layout.cp > 1 and strategy.max_world_size == 1:
        raise ConfigError(f"strategy '{strategy.name}' does not run with parallel.cp > 1: the cp ranks' gradients "
                          f"are averaged over the data axis; choose a data-parallel strategy (ddp, zero1-3, fsdp)")
    if layout.cp > 1 and (cfg.sequence_parallel or cfg.tp_impl == "torch" or cfg.pp_impl == "torch"):
        raise ConfigError("parallel.cp > 1 runs with the hand-rolled tensor parallelism without sequence "
                          "parallelism and the hand-rolled pipeline only: the references and sequence shards "
                          "expect whole sequences")
    if loop.compile and layout.cp > 1:
        raise ConfigError("train.compile with parallel.cp > 1 is not supported yet: the ring's sends are not "
                          "traced; set train.compile false")
    if loop.noise_scale:
        check_noise_scale(layout, strategy, loop)
    if cfg.muon_redundant and loop.optimizer != "muon":
        raise ConfigError("parallel.muon_redundant has no effect without train.optimizer muon")
    if loop.optimizer == "muon" and strategy.owns_step:
        raise ConfigError(f"train.optimizer muon does not run under strategy '{strategy.name}': its engine steps its "
                          "own optimizer (AdamW)")
    if loop.compile and layout.ep > 1:
        raise ConfigError("train.compile with parallel.ep > 1 is not supported yet: the exchanges' split sizes are "
                          "read on the host mid-forward; set train.compile false")


def check_noise_scale(layout: Layout, strategy: type, loop: LoopSettings) -> None:
    """Raise ConfigError (one line) where train.noise_scale cannot read each micro-batch's whole gradient."""
    if strategy.owns_step:
        raise ConfigError(f"train.noise_scale does not run under strategy '{strategy.name}': its engine syncs the "
                          "gradients inside its backward and hands no micro-batch's gradient out")
    for other in ("pp", "cp"):
        if layout.ep > 1 and getattr(layout, other) > 1:
            raise ConfigError(f"train.noise_scale does not run with parallel.ep > 1 and parallel.{other} > 1 together "
                              "yet: each use of an expert would give only a part of a micro-batch's gradient")
    if layout.dp * loop.accum_steps < 2:
        raise ConfigError("train.noise_scale needs two or more micro-batches a step (the small batch against the "
                          "step's): raise train.batch_tokens above one micro-batch of every data-parallel rank")


def check_model(cfg: ParallelConfig, model: ModelConfig) -> None:
    """Raise ConfigError (one line) when the model's layers or sequence cannot be split as the layout asks."""
    parts = 2 * cfg.cp if cfg.cp_split == "zigzag" else cfg.cp
    if cfg.cp > 1 and model.block_size % parts:
        raise ConfigError(f"model.block_size ({model.block_size}) must be a multiple of {parts} (parallel.cp "
                          f"{cfg.cp}, {cfg.cp_split} split: {parts} chunks of the sequence)")
    if cfg.pp > 1 and model.n_layer % cfg.pp:
        raise ConfigError(f"parallel.pp ({cfg.pp}) must divide model.n_layer ({model.n_layer}): stages hold "
                          f"equal numbers of blocks")
    if cfg.pp > 1 and model.n_layer % (cfg.pp * cfg.pp_virtual):
        raise ConfigError(f"parallel.pp × parallel.pp_virtual ({cfg.pp} × {cfg.pp_virtual}) must divide "
                          f"model.n_layer ({model.n_layer}): virtual stages hold equal numbers of blocks")
    if cfg.cp > 1 and model.moe_experts:
        raise ConfigError("parallel.cp > 1 cannot shard a mixture of experts' tokens (the router balances whole "
                          "sequences, as single does); use cp 1")
    if cfg.cp > 1 and model.dropout:
        raise ConfigError(f"parallel.cp > 1 runs without dropout (ring attention has none), got model.dropout "
                          f"{model.dropout}")
    if cfg.ep > 1 and not model.moe_experts:
        raise ConfigError(f"parallel.ep ({cfg.ep}) splits a mixture of experts: set model.moe_experts")
    if cfg.ep > 1 and model.moe_experts % cfg.ep:
        raise ConfigError(f"parallel.ep ({cfg.ep}) must divide model.moe_experts ({model.moe_experts}): every "
                          f"rank of an expert-parallel group holds as many experts")
    if cfg.tp == 1:
        return
    if model.moe_experts and cfg.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel cannot split a mixture of experts' tokens (the router "
                          "balances whole sequences); set sequence_parallel false")
    problem = accounting.tensor_parallel_split_problem(model, cfg.tp, cfg.sequence_parallel)
    if problem is not None:
        raise ConfigError(problem)
    if cfg.tp_impl == "torch" and model.moe_experts:
        raise ConfigError("parallel.tp_impl torch cannot split a mixture of experts; use tp_impl lab")
    if cfg.tp_impl == "torch" and model.vocab_size is not None and \
            accounting.padded_vocab(model) != model.vocab_size:
        raise ConfigError("parallel.tp_impl torch cannot leave padding rows out of its loss; set "
                          "model.pad_vocab_to 1")


def check_strategy(cfg: ParallelConfig, cls: type, world: int, loop: LoopSettings) -> None:
    """Raise ConfigError (one line) when the strategy cannot run on the ``world`` ranks of its data axis, or what the
    loop asks of it."""
    if world < cls.min_world_size:
        raise ConfigError(f"strategy '{cls.name}' needs at least {cls.min_world_size} processes, got "
                          f"world size {world} (start it with torchrun --nproc_per_node=N)")
    if cls.max_world_size is not None and world > cls.max_world_size:
        raise ConfigError(f"strategy '{cls.name}' runs on at most {cls.max_world_size} process(es), "
                          f"got world size {world}: choose a data-parallel --strategy (ddp, zero1, zero2, "
                          f"zero3, fsdp) or run fewer processes")
    if loop.compile and not cls.compiles:
        raise ConfigError(f"train.compile is not supported under strategy '{cls.name}' (dynamo cannot trace "
                          f"parameters sharded at rest); set train.compile false or choose another strategy")
    if cls is not DeepSpeed:
        return
    if cfg.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"parallel.zero_stage must be one of 1, 2, 3, got {cfg.zero_stage}")
    if loop.compile and cfg.zero_stage == 3:
        raise ConfigError("train.compile is not supported under deepspeed with parallel.zero_stage 3 (dynamo "
                          "cannot trace its partitioned parameters); set train.compile false or a lower stage")
    if cfg.offload == "all" and cfg.zero_stage != 3:
        raise ConfigError(f"parallel.offload all (parameters too) needs parallel.zero_stage 3, got "
                          f"{cfg.zero_stage}")
    engine_config(cfg, world, loop)
    import_deepspeed()


def check_precision(cfg: ParallelConfig, precision: Precision) -> None:
    """Raise ConfigError (one line) when the strategy cannot run the precision policy."""
    cls = strategy_class(cfg.strategy)
    if precision.scales_loss and cls is DeepSpeed:
        raise ConfigError(f"strategy '{cls.name}' does not run train.dtype fp16: {DeepSpeed.runs_fp16}")
