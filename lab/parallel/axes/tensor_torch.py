"""The reference for the hand-rolled tensor parallelism: the same layouts through torch's DTensor
(``parallel.tp_impl torch``; the class docstring says how)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lab.model.plan import ParallelPlan
from lab.parallel.axes import replace_module
from lab.parallel.axes.tensor import Split, TensorParallel
from lab.runtime import compat
from lab.runtime.config import ConfigError


def as_dtensor(local: torch.Tensor, layout: tuple) -> torch.Tensor:
    """``local`` as the DTensor of ``layout`` (its mesh, placements, shape and stride) it is the local part of
    (differentiable: the backward hands the local part its gradient in the weight's layout)."""
    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class HoldsLocal(nn.Module):
    """What a module with split weights adds to its class under the reference: between forwards its weights are
    plain parameters of their local parts (``dtensor_layouts``: by name, what each is the local part of), during its
    forward the DTensors they belong to."""

    dtensor_layouts: dict[str, tuple]

    def forward(self, *args: object, **kwargs: object) -> object:
        held = {name: self._parameters[name] for name in self.dtensor_layouts}  # a strategy may have swapped them
        try:  # restored however the forward ends (a recomputation for activation checkpointing stops early)
            self._parameters.update({name: as_dtensor(p, self.dtensor_layouts[name]) for name, p in held.items()})
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(held)


_LOCAL: dict[type[nn.Module], type[nn.Module]] = {}


def holding_local(kind: type[nn.Module]) -> type[nn.Module]:
    """``kind`` holding its split weights as local parts (``HoldsLocal``): one subclass per class, made once."""
    if kind not in _LOCAL:
        _LOCAL[kind] = type(f"Local{kind.__name__}", (HoldsLocal, kind), {})
    return _LOCAL[kind]


class SharedColumnLinear(nn.Linear):
    """A column split whose last blocks have fewer parts than ranks (QKV with fewer key/value heads than ranks): it
    holds the hand-rolled shard (this rank's ``queries`` rows of the split blocks, then the rows of its replicated
    parts) and runs on the group as a 2-D ``parts_mesh`` (parts × the ranks sharing one; rank r at (r // sharers,
    r % sharers), so ``between`` on both axes is rank r's sequence shard): the split rows ``Shard(0)`` on both axes,
    the replicated rows ``Shard(0)`` on the first and ``Replicate()`` on the second. Each rank's replicated output
    feeds only its own share of the rest (its query heads), so its gradient is ``Partial()`` over the sharers: the
    backward of ``from_local`` sums the replicated weights' gradients over them."""

    parts_mesh: object
    between: object
    queries: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.parts_mesh
        x = DTensor.from_local(x, mesh, [self.between, self.between]).redistribute(mesh, [Replicate(), Replicate()])
        out = []
        for rows, layout, grad in ((slice(None, self.queries), [Shard(0), Shard(0)], [Shard(2), Shard(2)]),
                                   (slice(self.queries, None), [Shard(0), Replicate()], [Shard(2), Partial()])):
            weight, bias = (None if p is None else DTensor.from_local(p[rows], mesh, layout, run_check=False)
                            for p in (self.weight, self.bias))
            out.append(F.linear(x, weight, bias).to_local(grad_placements=grad))
        return torch.cat(out, dim=-1)


class DTensorVocabLoss(nn.Module):
    """The loss from the head's weight sharded by vocabulary rows (``layout``: the local part's DTensor), under
    ``loss_parallel``; the final norm's output arrives in ``between`` and is gathered whole for the head."""

    def __init__(self, mesh: object, between: object, layout: tuple, divisor: float):
        super().__init__()
        self.mesh, self.between, self.layout, self.divisor = mesh, between, layout, divisor

    def forward(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        x = DTensor.from_local(x, self.mesh, [self.between]).redistribute(self.mesh, [Replicate()])
        logits = F.linear(x, as_dtensor(weight, self.layout))
        if self.divisor != 1:
            logits = logits / self.divisor
        if targets is None:
            return logits.full_tensor()
        with loss_parallel():  # the local part is a view: cloned, as FSDP2 wants a root's output
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).to_local().clone()


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

    def parallelize(self, model: nn.Module, plan: ParallelPlan) -> nn.Module:
        from torch.distributed.tensor import distribute_tensor
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
            self._shard(model, name, 0, column.blocks, shared)
            replace_module(model, name, SharedColumnLinear, parts_mesh=parts_mesh, between=between,
                           queries=sum(column.blocks[:replicated[0]]) // self.n)
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
        for name, module in list(model.named_modules()):
            layouts = {attr: (p.device_mesh, p.placements, p.shape, p.stride())
                       for attr, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
            if layouts:
                self._hold_local(model, name, layouts)
        layout = model.get_submodule(head_owner).dtensor_layouts[head_attr]
        parent, _, child = tensor.loss.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                DTensorVocabLoss(mesh, between, layout, tensor.logit_divisor))
        return model

    @staticmethod
    def _hold_local(model: nn.Module, name: str, layouts: dict[str, tuple]) -> None:
        """Make module ``name``'s DTensor weights (``layouts``: each one's mesh, placements, shape and stride) plain
        parameters of their local parts, seen as DTensors in its forward (``HoldsLocal``)."""
        if not name:
            raise ValueError("parallel.tp_impl torch: the model's root holds a split weight of its own")
        module = replace_module(model, name, holding_local(type(model.get_submodule(name))), dtensor_layouts=layouts)
        for attr, p in list(module.named_parameters(recurse=False)):
            if attr in layouts:
                setattr(module, attr, nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad))

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

    def autograd(self) -> contextlib.AbstractContextManager:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def meters(self) -> dict[str, object]:
        return {}  # torch's collectives are not counted


