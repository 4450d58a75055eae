"""DeepSpeed's engine as a strategy: ZeRO stages 1-3, CPU offload, behind the lab's one interface.

``--strategy deepspeed --parallel.zero_stage 1|2|3`` hands the model and the lab's own AdamW to
``deepspeed.initialize``; every call of the interface is delegated to the engine:

- **Config**: the engine's JSON is built from the lab's config. The values the lab owns come from
  it and are written in: micro-batch, accumulation steps and train batch size, gradient clipping,
  precision (bf16 autocast runs as ``torch_autocast``: fp32 weights, bf16 autocast, as for every strategy; the
  mixed policy as DeepSpeed's own ``bf16`` section: bf16 weights and gradients, fp32 master partitions and
  moments, gradients reduced in ``communication_data_type``, the policy's ``reduce_dtype``; fp16 is refused: its
  loss scaler would be DeepSpeed's, not the lab's),
  the ZeRO stage and offload from ``[parallel]``, the lab's AdamW (no ``optimizer``
  or ``scheduler`` section: ``step(lr)`` sets the learning rate every step) and the comms logger
  the meters read. ``parallel.deepspeed_config FILE`` passes a user's own DeepSpeed JSON through;
  it may repeat these values (or say ``"auto"``) but a contradiction is refused in one line that
  names the key. Everything else in the file reaches the engine as written.
- **Offload**: ``parallel.offload optimizer`` puts the fp32 master partition, Adam's moments and
  the update on the host (ZeRO-Offload, with the lab's AdamW as a client optimizer); ``all`` (stage
  3) also keeps the parameter partitions there.
- **A step**: ``forward`` sets the engine's accumulation boundary from ``sync``, ``backward`` is the
  engine's (the loop has already divided the loss by the accumulation steps), ``clip_grad_norm``
  returns DeepSpeed's own global norm of the reduced gradients (before clipping: the engine clips
  inside ``step`` at the configured ``gradient_clipping``), ``step(lr)`` sets the rate and calls
  ``engine.step()``; ``skip_step`` also calls it: with a non-finite gradient the engine discards
  the step itself.
- **Checkpoints** are the lab's format: each rank hands over live views of its fp32 master
  partition and Adam's moments, per parameter and range (ZeRO 1-2 through DeepSpeed's tensor
  fragments, stage 3 through its per-parameter partitions); ``after_load`` copies the loaded
  masters into the weights the model computes with. A DeepSpeed run therefore resumes under any
  strategy and world size and is exported and sampled like any other.
- **Meters**: model-state bytes are measured from the engine's tensors (weights, the reduced
  gradients at the step boundary, the master partition and moments); communication is counted by
  DeepSpeed's comms logger, every collective DeepSpeed issues by its message size, converted to
  bytes sent with the ring convention of ``lab.measure.accounting``; one-element messages (the gradient
  norm) are bookkeeping and not counted, as for the other strategies.

On a CPU the accelerator is DeepSpeed's ``cpu`` one over the gloo group the lab starts
(``DS_ACCELERATOR=cpu`` is set when no GPU is visible). Its shared-memory all-reduce kernel, a C++
op DeepSpeed would compile at the first ``initialize``, serves only inference and is turned off, so
no option of this strategy compiles anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from lab.measure import accounting
from lab.measure.device import Precision
from lab.measure.placement import Costs
from lab.model.plan import plan_of
from lab.parallel import axes, holding
from lab.parallel.accounts import Accounts, storage_bytes
from lab.parallel.axes.activations import SavedBytes
from lab.parallel.base import ModelFactory, OptimizerFactory, ParamGroupRule, set_lr
from lab.parallel.comm import Comm, join_group_of_one
from lab.parallel.engine import layout_digest, parallelize
from lab.parallel.holding import Piece, materialize_adam_state
from lab.parallel.layout import LoopSettings, Mesh, World
from lab.parallel.meters import RunMeters, StepMeters
from lab.runtime import compat
from lab.runtime.checkpoint import CheckpointState
from lab.runtime.config import ConfigError, ParallelConfig

EXTRA = "pip install '.[deepspeed]'"
ZERO_STAGES = (1, 2, 3)
MOMENTS = ("exp_avg", "exp_avg_sq")
# DeepSpeed's collectives, by the name its comms logger records, as the lab counts them; its message
# size is the tensor argument: the whole tensor, or an all-gather's input (one rank's share). A reduce
# to one rank sends what a reduce-scatter does in a ring.
_KINDS = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "inference_all_reduce": "all_reduce",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_fn": "reduce_scatter",
          "reduce_scatter": "reduce_scatter", "reduce": "reduce_scatter", "all_gather_into_tensor": "all_gather",
          "allgather_fn": "all_gather", "all_gather": "all_gather", "broadcast": "broadcast"}
_GATHER_INPUTS = {"all_gather_into_tensor", "allgather_fn", "all_gather"}


def import_deepspeed() -> ModuleType:
    """DeepSpeed, quiet, on the CPU accelerator when no GPU is visible; ConfigError naming the extra when absent."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as e:
        raise ConfigError(f"strategy 'deepspeed' needs DeepSpeed, which is not installed ({e}); install the "
                          f"extra: {EXTRA}") from None
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # only inference uses the shared-memory kernel; without this DeepSpeed compiles it (~23 s) at initialize
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed calls torch's flat collectives by their pre-2.13 names
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*(all_gather_into_tensor|reduce_scatter_tensor)")
    return deepspeed


# ---------------------------------------------------------------- the engine's config


def _lab_values(cfg: ParallelConfig, world_size: int, loop: LoopSettings,
                precision: Precision | None) -> dict[str, tuple[Any, str]]:
    """The settings the lab owns, by dotted DeepSpeed key: (value, the lab option it comes from); precision
    is left out when ``precision`` is None (not known before the device is)."""
    offload = {"none": ("none", "none"), "optimizer": ("cpu", "none"), "all": ("cpu", "cpu")}[cfg.offload]
    values: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (loop.micro_batch, "train.micro_batch"),
        "gradient_accumulation_steps": (loop.accum_steps, "the accumulation steps"),
        "train_batch_size": (loop.micro_batch * loop.accum_steps * world_size, "train.batch_tokens"),
        "gradient_clipping": (loop.grad_clip, "train.grad_clip"),
        "zero_optimization.stage": (cfg.zero_stage, "parallel.zero_stage"),
        "zero_optimization.offload_optimizer.device": (offload[0], "parallel.offload"),
        "zero_optimization.offload_param.device": (offload[1], "parallel.offload"),
        "zero_allow_untested_optimizer": (True, "the lab's AdamW"),
        "zero_force_ds_cpu_optimizer": (False, "the lab's AdamW"),
        "comms_logger.enabled": (True, "the lab's communication meter"),
        "comms_logger.prof_all": (True, "the lab's communication meter"),
    }
    if cfg.zero_stage == 3:
        # DeepSpeed's memory-efficient linear replaces torch.nn.functional.linear in the whole process, for
        # good, and gives wrong gradients under selective checkpointing (measured: 4 % off the norm)
        values["zero_optimization.memory_efficient_linear"] = (False, "the lab's correctness checks")
    if precision is not None:
        # autocast: gradients are reduced in fp32, as under every strategy (DeepSpeed would send nn.Linear's in bf16)
        values |= {"torch_autocast.enabled": (precision.autocasts, "train.dtype"),
                   "torch_autocast.dtype": ("bfloat16", "train.dtype"),
                   "torch_autocast.lower_precision_safe_modules": ([], "train.dtype")}
        if precision.mixed:
            reduce = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[precision.reduce_dtype]
            values |= {"bf16.enabled": (True, "train.precision"),
                       "communication_data_type": (reduce, "train.reduce_dtype")}
    return values


# Sections the lab owns outright: present and enabled, they contradict it.
_REFUSED = {"optimizer": "the optimizer is the lab's AdamW (train.beta1, train.beta2, train.weight_decay)",
            "scheduler": "the learning-rate schedule is the lab's (train.schedule; step(lr) sets it each step)",
            "fp16": "precision is the lab's (train.dtype)", "bf16": "precision is the lab's (train.dtype and "
            "train.precision: bf16 autocast runs as torch_autocast with fp32 weights, train.precision mixed writes "
            "this section)", "amp": "precision is the lab's (train.dtype)"}
# Lab defaults a user's file may change: buckets of 25 MiB of fp32 elements as the lab's own strategies use
# (DeepSpeed's 5e8 would reserve 2 GB per bucket), and stage 3 shards every parameter, as ZeRO-3 does.
_BUCKET = 25 * 2**20 // 4
_DEFAULTS = {"steps_per_print": None, "zero_optimization": {
    "reduce_bucket_size": _BUCKET, "allgather_bucket_size": _BUCKET, "stage3_param_persistence_threshold": 0}}


def read_user_config(path: str) -> dict[str, Any]:
    """A user's DeepSpeed JSON (an object); ConfigError (one line) when missing or invalid."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"parallel.deepspeed_config: no such file: {p}")
    try:
        tree = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"parallel.deepspeed_config {p}: not valid JSON ({e})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"parallel.deepspeed_config {p}: expected a JSON object, got {type(tree).__name__}")
    return tree


def engine_config(cfg: ParallelConfig, world_size: int, loop: LoopSettings,
                  precision: Precision | None = None) -> dict[str, Any]:
    """The engine's config: the user's file (if any) over the lab's defaults, with the lab's own values
    written in; ConfigError naming the key when the file contradicts one of them."""
    user = read_user_config(cfg.deepspeed_config) if cfg.deepspeed_config else {}
    where = f"parallel.deepspeed_config {cfg.deepspeed_config}"
    for section, why in _REFUSED.items():
        value = user.get(section)
        enabled = value is not None and (section in ("optimizer", "scheduler") or not isinstance(value, dict)
                                         or value.get("enabled", False))
        if enabled:
            raise ConfigError(f"{where}: \"{section}\" contradicts the lab: {why}; remove it")
    config = _merge(_DEFAULTS, user)
    zero = config.get("zero_optimization", {})
    if "param_persistence_threshold" in user.get("zero_optimization", {}):
        zero.pop("stage3_param_persistence_threshold", None)  # the user named it by its other alias
    for key, (value, source) in _lab_values(cfg, world_size, loop, precision).items():
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{where}: \"{'.'.join(parents)}\" must be an object")
            node = child
        given = node.get(leaf, "auto")
        if given != "auto" and not _same(given, value):
            raise ConfigError(f"{where}: \"{key}\" is {json.dumps(given)} but the lab sets {json.dumps(value)} "
                              f"(from {source}); remove the key or change {source}")
        node[leaf] = value
    return config


def _same(given: Any, value: Any) -> bool:
    """Equal values, where JSON's true is not the number 1."""
    if isinstance(value, bool) or isinstance(given, bool):
        return given is value
    return given == value


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, objects merged key by key (both left untouched)."""
    out = json.loads(json.dumps(base))
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ---------------------------------------------------------------- the strategy


class DeepSpeed:
    """DeepSpeed's engine, its own path beside the lab's (``lab.parallel.engine.Engine``), with the same calls for the
    loop; see the module docstring."""

    name = "deepspeed"
    options = frozenset({"zero_stage", "offload", "deepspeed_config"})
    offload_modes = ("none", "optimizer", "all")
    costs = Costs("zero{zero_stage}", "zero{zero_stage}")  # its stage's rows (``build`` fills in the rest)
    min_world_size, max_world_size, compiles, shards, builds_on_meta = 1, None, True, "optimizer", False
    runs_fp16 = "its loss scaler would be DeepSpeed's, not the lab's (checkpoints, the step line); use bf16"
    owns_step = "its engine owns the whole step over the whole world; choose any other strategy"

    def __init__(self, mesh: Mesh, cfg: ParallelConfig, precision: Precision, loop: LoopSettings):
        self.mesh, self.cfg, self.precision, self.loop = mesh, cfg, precision, loop
        self.data = self.everyone = mesh.world  # the engine runs over the whole world, its only axis
        self.comm = Comm(self.data.world_size, self.data.group, axis="dp")
        self.saved = SavedBytes()
        # activation checkpointing, the one transform it runs with (the plan refuses the axes beside it)
        self.transforms = axes.transforms(mesh, cfg, loop, self.saved, precision.param_dtype)
        self.stage = cfg.zero_stage
        self.config = engine_config(cfg, self.data.world_size, loop, precision)
        self.ds = import_deepspeed()
        accelerator = self.ds.accelerator.get_accelerator().device_name()
        if accelerator != self.data.device.type:
            raise ConfigError(f"DeepSpeed's accelerator is '{accelerator}' but the run's device is {self.data.device}; "
                              f"set DS_ACCELERATOR={self.data.device.type}")
        if self.data.world_size == 1:  # one process: the engine still wants torchrun's variables and a process group
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            if not dist.is_initialized():
                join_group_of_one(self.data.device)
        self.grad_bytes: int | None = None
        self.module: torch.nn.Module | None = None
        self.master_partitions: list[torch.Tensor] = []  # this rank's flat fp32 masters, one per group
        self.masters = None  # no masters of whole weights (the accounts' theory reads this)
        self.accounts = Accounts(self, measure=self._state_bytes)
        self.meters = RunMeters(lambda: [self.comm], self.transforms, self.saved, self.everyone, [],
                                self.accounts.record)
        self.accounts.parts = self.meters.figures
        self._after_load: list = []

    def describe(self) -> str:
        return f"{self.name} (ZeRO stage {self.cfg.zero_stage})"

    def world_of(self, name: str) -> World:
        return self.data

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------ building

    def build(self, model_factory: ModelFactory, param_group_rule: ParamGroupRule,
              optimizer_factory: OptimizerFactory) -> None:
        """The model and the lab's AdamW as every strategy builds them (fp32, in place), then the engine around both.
        Under mixed precision the engine's master partitions start from the fp32 weights, as every strategy's masters
        do (DeepSpeed would copy them from the bf16 weights it casts first)."""
        with torch.device(self.data.device):
            self.module = model_factory()
            parallelize(self.module, plan_of(self.module, model_factory), self.transforms)
        self.data.check_same(layout_digest(self.module), "the model (parameter names and shapes)")
        params = dict(self.module.named_parameters())
        optimizer = optimizer_factory([{"params": [params[n] for n in g.names], **g.options()}
                                       for g in param_group_rule(self.module) if g.names])
        initial = {n: p.detach().clone() for n, p in params.items()} if self.precision.mixed else {}
        self.engine, self.optimizer, _, _ = self.ds.initialize(model=self.module, optimizer=optimizer,
                                                               config=self.config)
        compat.check_deepspeed_optimizer(self.optimizer, self.stage)
        opt = self.optimizer
        self.master_partitions = list(opt.fp32_partitioned_groups_flat if self.stage == 3
                                      else opt.single_partition_of_fp32_groups)
        row = f"zero{self.stage}"
        self.costs = Costs(row, row, ((self.data.world_size, sum(getattr(p, "ds_numel", p.numel())
                                                                 for p in self.trainable)),),
                           offloaded=self.cfg.offload != "none")
        if initial:
            with torch.no_grad():
                for piece in self.holding():
                    piece.weight.copy_(initial[piece.name].view(-1)[piece.lo:piece.lo + piece.weight.numel()])
            self._restore_derived()
        self.meters.watch_model(self.module)
        self._logged()  # the engine's set-up traffic (broadcasting rank 0's weights) is not a step's

    # ------------------------------------------------------------ one step

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """The engine's forward (its config carries the precision); ``sync`` marks the accumulation boundary."""
        self.engine.set_gradient_accumulation_boundary(sync)
        with self.saved.counting(self.module):
            return self.engine(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loop divided the loss already

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """DeepSpeed's global norm of the reduced gradients; the engine clips in ``step`` at its configured value."""
        if max_norm != self.loop.grad_clip:
            raise ValueError(f"the engine clips at {self.loop.grad_clip} (its config), not {max_norm}")
        if self.grad_bytes is None:
            self.grad_bytes = self._gradient_bytes()
        if self.stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            return combine_grad_norm_groups(self.optimizer._get_norm_groups()).float()
        return self.optimizer.scaled_global_norm().float()

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.engine.step()
        self.accounts.measure_once()

    def skip_step(self) -> None:
        """The engine's step: it finds the non-finite norm itself, leaves the weights and clears the gradients."""
        self.engine.step()

    def take_step_meters(self) -> StepMeters:
        self._take_logged()
        return self.meters.take_step()

    def take_record(self) -> dict[str, object]:
        return self.meters.take_record()

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.engine.eval()
        try:
            with self._uncounted():
                return self.engine(x, y)
        finally:
            self.engine.train()

    def precision_record(self) -> dict[str, float]:
        return {}  # no loss scale: fp16 is refused

    def checkpoint_meta(self) -> dict[str, dict]:
        return {}

    def load_checkpoint_meta(self, meta: dict) -> None:
        """Nothing to go on with: the lab's bf16 policies keep no loss scale, and the noise scale is refused."""

    # ------------------------------------------------------------ communication, from DeepSpeed's comms logger

    @contextlib.contextmanager
    def _uncounted(self) -> Iterator[None]:
        from deepspeed.comm import comms_logger

        before, comms_logger.enabled = comms_logger.enabled, False
        try:
            yield
        finally:
            comms_logger.enabled = before

    def _logged(self) -> tuple[dict[str, dict[int, list]], float]:
        """What the comms logger recorded since the last call, then forgotten: (op → message size → record,
        seconds spent inside the collectives). Its timers keep every call, so they are emptied here too."""
        from deepspeed.comm import comm, comms_logger

        logged, comms_logger.comms_dict = comms_logger.comms_dict, {}
        seconds = sum(timer.elapsed(reset=True) for timer in comm.timers.get_timers().values()) / 1e3
        return logged, seconds

    def _take_logged(self) -> None:
        """Add the logged collectives to the lab's meter: bytes sent by kind, and their time as waiting."""
        n = self.data.world_size
        logged, seconds = self._logged()
        self.comm.add_wait(seconds)
        for op, sizes in logged.items():
            kind = _KINDS.get(op)
            for size, (count, *_) in sizes.items():
                if kind is None or size <= 8:  # barriers; one-element messages (norms, flags) are bookkeeping
                    continue
                whole = size * n if op in _GATHER_INPUTS else size
                self.comm.add_sent(kind, count * accounting.ring_elements_sent(kind, whole, n))

    # ------------------------------------------------------------ state

    def holding(self) -> list[Piece]:
        """Each parameter's range in this rank's fp32 master partition (what the engine's weights are copied from),
        and its Adam moments, as live views (the engine keeps its gradients: it clips them itself)."""
        opt, masters, out = self.optimizer, self.master_partitions, []
        moments_of = {id(m): opt.optimizer.state.get(m) or None for m in masters}
        for name, p in self.module.named_parameters():
            numel = p.ds_numel if self.stage == 3 else p.numel()
            lo, view, moments, lo_in = 0, torch.empty(0), None, 0
            if self.stage == 3:
                group, offset, size = opt.grad_position[opt.get_param_id(p)]
                lo = self.data.rank * p.partition_numel()
                size = max(0, min(size, numel - lo))
                if size:
                    view, lo_in = masters[group].narrow(0, offset, size), offset
                    moments = moments_of[id(masters[group])]
            elif (mapping := compat.deepspeed_fragment(p)) is not None:
                lo, lo_in, size = mapping.lp_fragment_address.start, mapping.hp_fragment_address.start, \
                    mapping.hp_fragment_address.numel
                view, moments = mapping.get_hp_fragment(), moments_of[id(masters[mapping.param_group_index])]
            out.append(Piece(name, numel, lo, view, None, moments, lo_in, sharded=True))
        return out

    def params_finite(self) -> bool:
        return holding.all_finite(self.holding(), self.everyone)

    def checkpoint_state(self) -> CheckpointState:
        """This rank's ranges of the master partition and Adam's moments (``holding.checkpoint_state``); Adam's states
        exist before the first step (zeros), so that a checkpoint loads into them."""
        if self.stage == 3:
            with compat.deepspeed_fp32_groups(self.optimizer):
                materialize_adam_state(self.optimizer.optimizer)
        else:
            materialize_adam_state(self.optimizer.optimizer)
        state, self._after_load = holding.checkpoint_state(self.holding(), [], self.everyone)
        return state

    @torch.no_grad()
    def after_load(self) -> None:
        """The weights the model computes with follow the loaded masters."""
        with self.meters.uncounted():
            for share in self._after_load:
                share()
        self._restore_derived()

    def _restore_derived(self) -> None:
        """The weights the model computes with from the masters (stages 1-2: gathered again)."""
        with self._uncounted():
            if self.stage == 3:
                for group in range(len(self.master_partitions)):
                    self.optimizer._reassign_or_swap_out_partitioned_parameters(group)
            else:
                self.optimizer.update_lp_params()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight (the fp32 masters, gathered by DeepSpeed) under the model's names, on rank 0."""
        from deepspeed.utils import safe_get_full_fp32_param

        with self._uncounted():  # every rank takes part in stage 3's gathers
            full = {id(p): safe_get_full_fp32_param(p).detach().cpu().clone() for p in self.module.parameters()}
        if not self.data.is_main:
            return {}
        params = dict(self.module.named_parameters(remove_duplicate=False))  # a tied weight under each name
        return {name: full[id(params[name])] if name in params else value.detach().cpu().clone()
                for name, value in self.module.state_dict().items()}

    # ------------------------------------------------------------ meters

    def _state_bytes(self) -> accounting.StateBytes:
        """Weights the model computes with, the gradients at the boundary (measured when the norm is taken), and the
        masters plus Adam's moments (a master partition that is the weights themselves, as in stage 3 without
        offload, counts once)."""
        opt = self.optimizer
        weights = list(opt.fp16_partitioned_groups_flat if self.stage == 3 else opt.bit16_groups_flat)
        stored = {t.untyped_storage().data_ptr() for t in weights}
        moments = [v for m in self.master_partitions for v in opt.optimizer.state.get(m, {}).values()
                   if torch.is_tensor(v)]
        masters = [m for m in self.master_partitions if m.untyped_storage().data_ptr() not in stored]
        return accounting.StateBytes(params=storage_bytes(weights), grads=self.grad_bytes or 0,
                                     optimizer=storage_bytes(moments + masters), offload=self.costs.offloaded)

    def _gradient_bytes(self) -> int:
        """Bytes of the gradients this rank holds at the step boundary, after the reduction."""
        opt = self.optimizer
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        grads += [g for group in opt.averaged_gradients.values() if group is not None for g in group if g is not None]
        grads += [m.grad for m in self.master_partitions if m.grad is not None]
        return storage_bytes(grads)
