"""The reference for the hand-rolled tensor parallelism: the same layouts through torch's DTensor
(``parallel.tp_impl torch``; the class docstring says how)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.model.plan import ParallelPlan
from lab.parallel.axes.tensor import Split, TensorParallel
from lab.parallel.layout import LoopSettings, World
from lab.runtime import compat
from lab.runtime.config import ConfigError


class TorchTensorParallel(TensorParallel):
    """The reference: the same layouts through torch's DTensor (``parallel.tp_impl torch``).

    ``parallelize_module`` with ``ColwiseParallel`` (QKV, MLP up), ``RowwiseParallel`` (attention output,
    MLP down, and the embedding with replicated ids), the head's weight sharded by vocabulary rows, and the
    loss under ``loss_parallel``. A fused weight (QKV; gate and up) is first reordered so that torch's even
    row split hands each rank the shard the hand-rolled split gives: the local tensors, and so the
    checkpoints, are the same. Under ``sequence_parallel`` the residual stream between the matmuls is
    ``Shard(1)``: ``SequenceParallel`` runs the norms (and, behind ``PrepareModuleInput``, the learned positions)
    on sequence shards, the column-parallel layers gather it and the row-parallel ones reduce-scatter into it.

    With fewer key/value heads than ranks (GQA), torch's even split of one fused weight cannot give every rank the
    head its query heads use: the QKV then holds the hand-rolled shard and runs on the group seen as a 2-D mesh
    (key/value heads × the ranks sharing one, ``DeviceMesh._unflatten``), where the key/value rows are
    ``[Shard(0), Replicate()]`` and their output's gradient ``Partial()`` over the sharers (``_qkv_shared_kv``).

    Between forwards each DTensor weight is a plain parameter of its local part, under its own name (what a
    data-parallel strategy's buffers, hooks and optimizer take, as under the hand-rolled split); a module sees
    the DTensor during its forward (``DTensor.from_local``, whose backward hands the local part its gradient in
    the weight's layout: a whole weight that met sequence shards gets its partial sums all-reduced).
    Its collectives are torch's own, not counted (no ``tp_comm_bytes``).
    """

    implementation = "torch"

    def __init__(self, world: World, sequence_parallel: bool, loop: LoopSettings | None = None,
                 data_ranks: int = 1):
        super().__init__(world, sequence_parallel, loop, data_ranks)
        self.layouts: dict[nn.Module, dict[str, tuple]] = {}  # module → its weights' DTensor layouts, by name

    def parallelize(self, model: nn.Module, plan: ParallelPlan) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        tensor, mesh = plan.tensor, self.world.device_mesh
        embedding = model.get_submodule(tensor.embedding)
        rows, width = embedding.weight.shape
        between = Shard(1) if self.sequence_parallel else Replicate()  # the residual stream between the matmuls
        styles: dict[str, object] = {tensor.embedding: RowwiseParallel(input_layouts=Replicate(),
                                                                       output_layouts=between)}
        for name, column in tensor.column.items():
            shared = column.shared(self.n)
            if not shared:
                self._reorder(model, name, column.blocks)
                styles[name] = ColwiseParallel(input_layouts=between)
                continue
            replicated = [b for b, k in enumerate(shared) if k > 1]
            if replicated != list(range(replicated[0], len(shared))) or len({shared[b] for b in replicated}) > 1:
                raise ConfigError(f"parallel.tp_impl torch replicates only the last blocks of '{name}', each alike")
            sharers = shared[replicated[0]]  # the group as a (parts × sharers) mesh
            parts_mesh = compat.unflatten_mesh(mesh, (self.n // sharers, sharers), ("kv_head", "kv_share"))
            module = self._shard(model, name, 0, column.blocks, shared)
            module.forward = functools.partial(self._column_shared, module, parts_mesh, between,
                                               sum(column.blocks[:replicated[0]]) // self.n)
        for name in tensor.row:
            module = model.get_submodule(name)
            self.splits[f"{name}.weight"] = Split(tuple(module.weight.shape), 1, (module.in_features,))
            styles[name] = RowwiseParallel(output_layouts=between)
        tensor.split_heads(self.n)
        if self.sequence_parallel:
            styles |= {name: SequenceParallel(use_local_output=True) for name in tensor.sequence_norms}
            if tensor.positions is not None:  # the positions [T] arrive whole: each rank looks up its tokens' rows
                parallelize_module(model.get_submodule(tensor.positions), mesh,
                                   PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()))
                styles[tensor.positions] = SequenceParallel(sequence_dim=0, use_local_output=True)
        self.splits[f"{tensor.embedding}.weight"] = Split((rows, width), 0, (rows,))
        # every rank built the same whole weights (or meta ones): each keeps its part, nothing is sent
        parallelize_module(model, mesh, styles, src_data_rank=None)
        head_owner, _, head_attr = tensor.head_weight.rpartition(".")
        head = model.get_submodule(head_owner)
        if head_owner != tensor.embedding:
            self.splits[tensor.head_weight] = Split((rows, width), 0, (rows,))
            setattr(head, head_attr, nn.Parameter(distribute_tensor(getattr(head, head_attr).detach(), mesh,
                                                                    [Shard(0)], src_data_rank=None)))
        for module in model.modules():
            self._hold_local(module)
        setattr(model, plan.head, functools.partial(self._torch_output, model.get_submodule(tensor.final_norm), head,
                                                    head_attr, tensor.logit_divisor, between))
        return model

    def _hold_local(self, module: nn.Module) -> None:
        """Make ``module``'s DTensor weights plain parameters of their local parts, seen as DTensors in its forward."""
        from torch.distributed.tensor import DTensor

        layouts = {name: (p.device_mesh, p.placements, p.shape, p.stride())
                   for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
        if not layouts:
            return
        self.layouts[module] = layouts
        for name, p in module.named_parameters(recurse=False):
            if name in layouts:
                setattr(module, name, nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad))
        forward = module.forward

        def as_distributed(*args: object, **kwargs: object) -> object:
            held = {name: module._parameters[name] for name in layouts}  # a data-parallel strategy may swap them
            try:  # restored however the forward ends (a recomputation for activation checkpointing stops early)
                module._parameters.update({name: self.distributed(module, name) for name in layouts})
                return forward(*args, **kwargs)
            finally:
                module._parameters.update(held)

        module.forward = as_distributed

    def distributed(self, module: nn.Module, name: str) -> torch.Tensor:
        """``module``'s weight ``name`` as the DTensor its local part belongs to (differentiable)."""
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.layouts[module][name]
        return DTensor.from_local(module._parameters[name], mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    @staticmethod
    def _column_shared(linear: nn.Linear, mesh: object, between: object, queries: int, x: torch.Tensor
                       ) -> torch.Tensor:
        """A column split whose last blocks have fewer parts than ranks (QKV with fewer key/value heads than ranks;
        ``linear`` holds the hand-rolled shard: this rank's ``queries`` rows of the split blocks, then the rows of
        its replicated parts), on the group as a 2-D ``mesh`` (parts × the ranks sharing one; rank r at
        (r // sharers, r % sharers), so ``between`` on both axes is rank r's sequence shard): the split rows
        ``Shard(0)`` on both axes, the replicated rows ``Shard(0)`` on the first and ``Replicate()`` on the second.
        Each rank's replicated output feeds only its own share of the rest (its query heads), so its gradient is
        ``Partial()`` over the sharers: the backward of ``from_local`` sums the replicated weights' gradients over
        them."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        x = DTensor.from_local(x, mesh, [between, between]).redistribute(mesh, [Replicate(), Replicate()])
        out = []
        for rows, layout, grad in ((slice(None, queries), [Shard(0), Shard(0)], [Shard(2), Shard(2)]),
                                   (slice(queries, None), [Shard(0), Replicate()], [Shard(2), Partial()])):
            weight, bias = (None if p is None else DTensor.from_local(p[rows], mesh, layout, run_check=False)
                            for p in (linear.weight, linear.bias))
            out.append(F.linear(x, weight, bias).to_local(grad_placements=grad))
        return torch.cat(out, dim=-1)

    def _reorder(self, model: nn.Module, name: str, blocks: tuple[int, ...]) -> None:
        """Order a fused weight's rows rank by rank (each rank's part of every block together), so that an even
        split of the rows is the hand-rolled shard."""
        module = model.get_submodule(name)
        for attr in ("weight", "bias"):
            param = getattr(module, attr, None)
            if param is None:
                continue
            split = Split(tuple(param.shape), 0, blocks)
            ordered = torch.cat([split.take(param.detach(), r, self.n) for r in range(self.n)])
            setattr(module, attr, nn.Parameter(ordered, requires_grad=param.requires_grad))
            self.splits[f"{name}.{attr}"] = split

    def _torch_output(self, norm: nn.Module, head: nn.Module, weight: str, divisor: float, layout: object,
                      x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = self.world.device_mesh  # the final norm's output in ``layout``, gathered whole for the head
        x = DTensor.from_local(norm(x), mesh, [layout]).redistribute(mesh, [Replicate()])
        logits = F.linear(x, self.distributed(head, weight))
        if divisor != 1:
            logits = logits / divisor
        if targets is None:
            return logits.full_tensor()
        with loss_parallel():  # the local part is a view: cloned, as FSDP2 wants a root's output
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).to_local().clone()

    def autograd(self) -> contextlib.AbstractContextManager:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def meters(self) -> dict[str, object]:
        return {}  # torch's collectives are not counted


