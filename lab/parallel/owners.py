"""Muon's orthogonalization (``newton_schulz``) and where it runs: over a data axis, each matrix's on one owner rank,
the results sent to every rank (``lab.training.muon``; where the ranks hold the matrices whole and their synced
gradients alike).

The owners are fixed once, from the matrices' shapes: largest first, each to the rank with the least Newton-Schulz
work so far (the longest-processing-time rule), so that every rank does about the same share of the iteration's
FLOPs (their largest over their mean: ``muon_owner_load``). A step orthogonalizes each rank's own matrices and
all-gathers the results in bf16 (what the iteration returns), each rank's laid end to end and padded to the largest
rank's total: one collective a step, counted by its own meter beside its theory, apart from the gradient sync's.
``parallel.muon_redundant`` makes every rank orthogonalize every matrix instead (no traffic; to compare).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lab.measure.accounting import newton_schulz_flops, ring_elements_sent
from lab.measure.figures import Figures
from lab.parallel.comm import Comm
from lab.parallel import holding
from lab.parallel.axes import Transform
from lab.parallel.holding import Piece
from lab.runtime.checkpoint import Blocks, Held, Pieces
from lab.parallel.layout import World

EPS = 1e-7  # the norm's floor before the iteration (torch.optim.Muon's)


def newton_schulz(update: torch.Tensor, coefficients: Sequence[float], steps: int) -> torch.Tensor:
    """U's orthogonalization: ``steps`` iterations of X ← aX + (bA + cA²)X with A = XXᵀ, in bf16, from X = U/‖U‖
    (the wide orientation: a tall matrix is transposed and back)."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.bfloat16()
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def rms_scale(shape: Sequence[int]) -> float:
    """Moonlight's factor on a matrix's orthogonalized update: 0.2 · √max(rows, cols), AdamW's update RMS."""
    return 0.2 * math.sqrt(max(shape[:2]))


# What an orthogonalizer returns for each tensor Muon steps: its parts, each a range of the flattened tensor (None:
# all of it, as the tensor's shape), the orthogonalized update of those elements, and the RMS factor of their matrix.
Part = tuple[slice | None, torch.Tensor, float]
Orthogonalizer = Callable[[list[torch.Tensor], list[torch.Tensor]], list[list[Part]]]


def assign_owners(flops: list[int], ranks: int) -> list[int]:
    """The owner rank of each matrix: largest first, each to the least-loaded rank (the lowest on a tie)."""
    loads, owners = [0] * ranks, [0] * len(flops)
    for i in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (loads[r], r))
        loads[owners[i]] += flops[i]
    return owners


class Owners(Figures):
    """The orthogonalizer of a ``MuonAdamW`` whose matrices every rank of ``comm`` holds whole."""

    line_place = 96

    def __init__(self, comm: Comm, orthogonalize: Callable[[torch.Tensor], torch.Tensor], ns_steps: int,
                 redundant: bool = False):
        self.comm, self.orthogonalize, self.ns_steps = comm, orthogonalize, ns_steps
        self.redundant = redundant or comm.world_size == 1
        self.owners: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.last = {"muon_sent_bytes": 0.0, "muon_orthogonalized": 0, "muon_s": 0.0}  # the last step's

    def _plan(self, updates: list[torch.Tensor]) -> None:
        shapes = [tuple(u.shape) for u in updates]
        if shapes != self.shapes:
            self.shapes = shapes
            self.owners = assign_owners([newton_schulz_flops(s, self.ns_steps) for s in shapes], self.comm.world_size)

    def __call__(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[list[Part]]:
        """Each update orthogonalized by its owner (or here, every one, when redundant), once a step."""
        self._plan(updates)
        t0 = time.perf_counter()
        if self.redundant:
            out = [self.orthogonalize(u) for u in updates]
            self.last = {"muon_sent_bytes": 0.0, "muon_orthogonalized": len(out), "muon_s": time.perf_counter() - t0}
        else:
            out = self._exchange(updates)
            self.last = {"muon_sent_bytes": self.comm.take().bytes.get("all_gather", 0.0),
                         "muon_orthogonalized": sum(owner == self.comm.rank for owner in self.owners),
                         "muon_s": time.perf_counter() - t0}
        return [[(None, o, rms_scale(o.shape))] for o in out]

    def _exchange(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's matrices orthogonalized, and every rank's all-gathered."""
        rank, n = self.comm.rank, self.comm.world_size
        mine = [self.orthogonalize(u) for u, owner in zip(updates, self.owners) if owner == rank]
        sizes = self._sizes()
        send = torch.zeros(max(sizes), dtype=torch.bfloat16, device=updates[0].device if updates else None)
        if mine:
            torch.cat([m.reshape(-1) for m in mine], out=send[:sizes[rank]])
        gathered = torch.empty(n * len(send), dtype=send.dtype, device=send.device)
        self.comm.all_gather(gathered, send)
        chunks, taken = gathered.view(n, -1), [0] * n
        out = []
        for shape, owner in zip(self.shapes, self.owners):
            numel = shape[0] * shape[1]
            out.append(chunks[owner, taken[owner]:taken[owner] + numel].view(shape))
            taken[owner] += numel
        return out

    def _sizes(self) -> list[int]:
        """Elements of each rank's results."""
        sizes = [0] * self.comm.world_size
        for shape, owner in zip(self.shapes, self.owners):
            sizes[owner] += shape[0] * shape[1]
        return sizes

    def theory_bytes(self) -> float:
        """Bytes this rank sends a step: its padded share of the all-gather (ring convention), bf16."""
        if self.redundant:
            return 0.0
        return ring_elements_sent("all_gather", self.comm.world_size * max(self._sizes()), self.comm.world_size) * 2

    def load(self) -> float:
        """The owners' Newton-Schulz FLOPs: the largest rank's over the mean."""
        if self.redundant or not self.shapes:
            return 1.0
        loads = [0] * self.comm.world_size
        for shape, owner in zip(self.shapes, self.owners):
            loads[owner] += newton_schulz_flops(shape, self.ns_steps)
        return max(loads) / (sum(loads) / len(loads))

    def record(self) -> dict[str, object]:
        return self.last | {"muon_sent_bytes_theory": self.theory_bytes(), "muon_owner_load": self.load()}

    def meters(self) -> dict[str, object]:
        return {"muon_sent_bytes_per_step_theory": self.theory_bytes(), "muon_owner_load": self.load(),
                "muon_redundant": self.redundant}

    @staticmethod
    def line(rec: dict) -> str:
        """Muon's orthogonalization time and the bytes it sent beside theory."""
        if "muon_s" not in rec:
            return ""
        return (f" | muon {rec['muon_s'] * 1e3:,.0f} ms, sent {rec['muon_sent_bytes'] / 2**10:,.0f} KiB "
                f"(theory {rec['muon_sent_bytes_theory'] / 2**10:,.0f})")


class Gathered(Owners):
    """The orthogonalizer of a ``MuonAdamW`` stepping pieces of matrices that the ranks of ``comm`` hold apart (a
    sharding strategy's flat chunks cut across matrices, or row blocks; a tensor split's columns or rows). ``matrices``:
    every matrix's whole shape, in one order on every rank; ``segments``: for each tensor this rank steps (by id), the
    (matrix, lo, hi, at) of each run of a matrix's flattened elements [lo, hi) it holds from its own element ``at``.

    A step sends each run's update (bf16, what the iteration reads) to its matrix's owner in one all-to-all, from the
    first rank that holds the run (ranks that hold the same run, replicas, send it once); the owner assembles and
    orthogonalizes the matrix, and a second all-to-all sends every holder of a run its part of the result. Who holds
    what is exchanged once, at the first step."""

    def __init__(self, comm: Comm, orthogonalize: Callable[[torch.Tensor], torch.Tensor], ns_steps: int,
                 matrices: list[tuple[int, int]], segments: dict[int, list[tuple[int, int, int, int]]]):
        super().__init__(comm, orthogonalize, ns_steps)
        self.redundant = False
        self.shapes, self.segments = [tuple(s) for s in matrices], segments
        self.owners = assign_owners([newton_schulz_flops(s, ns_steps) for s in self.shapes], comm.world_size)
        self.held: list[list[tuple[int, int, int]]] | None = None  # every rank's (matrix, lo, hi), in sending order
        self.sender: dict[tuple[int, int, int], int] = {}  # each run's first holder

    def _plan(self, updates: list[torch.Tensor]) -> None:
        """Who holds what: every rank's runs, in the order it sends them (by owner, then as it holds them)."""
        if self.held is None:
            mine = sorted({(m, lo, hi) for runs in self.segments.values() for m, lo, hi, _ in runs})
            mine.sort(key=lambda run: self.owners[run[0]])  # stable: by owner, then as held
            self.held = [mine] * self.comm.world_size
            if self.comm.world_size > 1:
                dist.all_gather_object(self.held, mine, group=self.comm.group)
            for rank in reversed(range(self.comm.world_size)):
                self.sender |= dict.fromkeys(self.held[rank], rank)
            ends = {m: 0 for m in range(len(self.shapes))}
            for m, lo, hi in sorted(self.sender):  # the runs tile each matrix: no element missing, none twice
                if lo != ends[m]:
                    raise RuntimeError(f"Muon: the ranks' runs of matrix {m} {self.shapes[m]} leave a gap or overlap "
                                       f"at element {min(lo, ends[m])}")
                ends[m] = hi
            if any(end != self.shapes[m][0] * self.shapes[m][1] for m, end in ends.items()):
                raise RuntimeError("Muon: the ranks hold less than every element of every matrix")

    def _sent(self, source: int, owner: int) -> list[tuple[int, int, int]]:
        """The runs ``source`` sends ``owner``: those of its matrices it is the first to hold."""
        return [run for run in self.held[source] if self.owners[run[0]] == owner and self.sender[run] == source]

    def _returned(self, holder: int, owner: int) -> list[tuple[int, int, int]]:
        """The runs ``owner`` sends back to ``holder``: every run of its matrices ``holder`` holds."""
        return [run for run in self.held[holder] if self.owners[run[0]] == owner]

    def __call__(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[list[Part]]:
        self._plan(updates)
        t0 = time.perf_counter()
        self.last = {"muon_sent_bytes": 0.0, "muon_orthogonalized": 0, "muon_s": 0.0}
        rank, n = self.comm.rank, self.comm.world_size
        runs = {}  # (matrix, lo, hi) -> (tensor index, at), one of this rank's copies
        for i, t in enumerate(tensors):
            for m, lo, hi, at in self.segments[id(t)]:
                runs[m, lo, hi] = (i, at)
        flats = [(u.to_local() if hasattr(u, "to_local") else u).reshape(-1) for u in updates]
        sent = [run for d in range(n) for run in self._sent(rank, d)]
        send = [flats[runs[r][0]][runs[r][1]:runs[r][1] + r[2] - r[1]] for r in sent]
        received = self._all_to_all(torch.cat(send).bfloat16() if send else torch.zeros(0, dtype=torch.bfloat16),
                                    [sum(hi - lo for _, lo, hi in self._sent(rank, d)) for d in range(n)],
                                    [sum(hi - lo for _, lo, hi in self._sent(s, rank)) for s in range(n)])
        results = self._assemble_and_orthogonalize(received)
        back = self._all_to_all(torch.cat([results[m][lo:hi] for s in range(n) for m, lo, hi in self._returned(s, rank)]
                                          or [received[:0]]),
                                [sum(hi - lo for _, lo, hi in self._returned(s, rank)) for s in range(n)],
                                [sum(hi - lo for _, lo, hi in self._returned(rank, d)) for d in range(n)])
        parts: list[list[Part]] = [[] for _ in tensors]
        taken = 0
        for m, lo, hi in (run for d in range(n) for run in self._returned(rank, d)):
            i, at = runs[m, lo, hi]
            parts[i].append((slice(at, at + hi - lo), back[taken:taken + hi - lo], rms_scale(self.shapes[m])))
            taken += hi - lo
        self.last["muon_s"] = time.perf_counter() - t0
        return parts

    def _all_to_all(self, send: torch.Tensor, split: list[int], arriving: list[int]) -> torch.Tensor:
        """``send`` cut by ``split`` to each rank; what arrives (``arriving`` from each), in rank order. Counts the
        bytes sent to other ranks."""
        out = send.new_empty(sum(arriving))
        self.last["muon_sent_bytes"] += (sum(split) - split[self.comm.rank]) * send.element_size()
        dist.all_to_all_single(out, send, arriving, split, group=self.comm.group)
        return out

    def theory_bytes(self) -> float:
        """Bytes this rank sends a step, bf16: the runs it sends owners, and back the runs other ranks hold of the
        matrices it owns."""
        if self.held is None:
            return 0.0
        rank, n = self.comm.rank, self.comm.world_size
        out = sum(hi - lo for d in range(n) if d != rank for _, lo, hi in self._sent(rank, d))
        back = sum(hi - lo for s in range(n) if s != rank for _, lo, hi in self._returned(s, rank))
        return 2.0 * (out + back)

    def _assemble_and_orthogonalize(self, received: torch.Tensor) -> dict[int, torch.Tensor]:
        """The owned matrices from the runs that came (in rank order), each orthogonalized and flattened."""
        rank = self.comm.rank
        whole = {m: received.new_empty(self.shapes[m][0] * self.shapes[m][1])
                 for m in range(len(self.shapes)) if self.owners[m] == rank}
        taken = 0
        for s in range(self.comm.world_size):
            for m, lo, hi in self._sent(s, rank):
                whole[m][lo:hi] = received[taken:taken + hi - lo]
                taken += hi - lo
        done = {m: self.orthogonalize(flat.view(self.shapes[m])).reshape(-1) for m, flat in whole.items()}
        self.last["muon_orthogonalized"] = len(done)
        return done


class Grouped(Figures):
    """Several orthogonalizers, each over the ranks that share its matrices (the data axis's, an expert group's, a
    pipeline stage's for a tensor split's), called in one order on every rank, each tensor's parts gathered from all
    of them; their figures added up (the load: the largest)."""

    line_place = Owners.line_place
    line = Owners.line

    def __init__(self, parts: list[tuple[Owners, set[int]]]):
        self.parts = parts  # each with the ids of the tensors it orthogonalizes

    def __call__(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[list[Part]]:
        out: list[list[Part]] = [[] for _ in tensors]
        for owners, ids in self.parts:
            mine = [i for i, t in enumerate(tensors) if id(t) in ids]
            for i, parts in zip(mine, owners([tensors[i] for i in mine], [updates[i] for i in mine]), strict=True):
                out[i] += parts  # a sharded tensor may hold pieces of matrices of several groups
        return out

    def record(self) -> dict[str, object]:
        records = [owners.record() for owners, _ in self.parts]
        total = {key: sum(r[key] for r in records) for key in records[0] if key != "muon_owner_load"}
        return total | {"muon_owner_load": max(r["muon_owner_load"] for r in records)}

    def meters(self) -> dict[str, object]:
        parts = [owners.meters() for owners, _ in self.parts]
        return {"muon_sent_bytes_per_step_theory": sum(m["muon_sent_bytes_per_step_theory"] for m in parts),
                "muon_owner_load": max(m["muon_owner_load"] for m in parts),
                "muon_redundant": all(m["muon_redundant"] for m in parts)}


def whole_runs(piece: Piece, transforms: Sequence[Transform]) -> list[tuple[int, torch.Tensor]]:
    """Where this rank's elements of ``piece`` (its fp32 value) sit in the whole flattened parameter: (first element,
    a flat view of them) for each run of consecutive ones (a tensor split's column shard: one run per row)."""
    value = piece.value
    found = next((r for t in transforms if (r := t.held_region(piece.name, piece.lo, value, piece.numel))), None)
    if found is None:
        return [(piece.lo, value)] if value.numel() else []
    if isinstance(found, Held):
        return [(found.lo, found.view)] if found.view.numel() else []
    if isinstance(found, Pieces):
        return [(lo, view) for lo, view in found.pieces if view.numel()]
    if isinstance(found, Blocks):
        cols = found.shape[1]
        return [((row + i) * cols + col, view[i]) for row, col, view in found.blocks for i in range(view.shape[0])]
    return [(0, found.reshape(-1))]


def locate(tensors: list[torch.Tensor], pieces: list[Piece], names: list[str], transforms: Sequence[Transform]
           ) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int, int, int]]]]:
    """Each of ``names``' whole shape, and for each of ``tensors`` (an optimizer's, by id) the (matrix, lo, hi, at) of
    each run of a matrix's flattened elements [lo, hi) it holds from its own element ``at`` on: each piece
    (``Strategy.holding``) placed in the whole matrix (``whole_runs``) and found in the tensor whose memory it lies
    in."""
    index = {name: i for i, name in enumerate(names)}
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    shapes: list[tuple[int, int]] = [(0, 0)] * len(names)
    segments: dict[int, list[tuple[int, int, int, int]]] = {id(t): [] for t in tensors}
    for piece in pieces:
        if piece.name not in index:
            continue
        shapes[index[piece.name]] = holding.whole_shape(piece, transforms)
        for lo, view in whole_runs(piece, transforms):
            for t, held in zip(tensors, local):
                at = (view.data_ptr() - held.data_ptr()) // view.element_size()
                if held.dtype == view.dtype and 0 <= at < held.numel():
                    segments[id(t)].append((index[piece.name], lo, lo + view.numel(), at))
                    break
    return shapes, segments


def distribute(optimizer: torch.optim.Optimizer, matrices: list[str], world_of: Callable[[str], World], whole: bool,
               redundant: bool, pieces: list[Piece], transforms: Sequence[Transform], stage: World
               ) -> Figures | None:
    """Set ``optimizer``'s orthogonalizer: for the ``matrices`` each world shares (``world_of``; a matrix a transform
    splits, the ranks of its pipeline stage, ``stage``), owners over its ranks, of whole matrices every rank holds
    alike (``whole``) or of the pieces the ranks hold (``pieces``: ``Strategy.holding``). None, and nothing set, for
    an optimizer without one (AdamW)."""
    if not hasattr(optimizer, "orthogonalizer"):
        return None
    split = {p.name for p in pieces if any(t.whole_shape(p.name) is not None for t in transforms)}
    worlds: dict[int, tuple[World, list[str]]] = {}
    for name in matrices:
        world = stage if name in split else world_of(name)
        worlds.setdefault(id(world.group), (world, []))[1].append(name)
    tensors = [t for g in optimizer.param_groups if g.get("muon") for t in g["params"]]
    parts: list[tuple[Owners, set[int]]] = []
    for world, names in worlds.values():
        shapes, segments = locate(tensors, pieces, names, transforms)
        comm = Comm(world.world_size, world.group, axis="dp")
        ids = {i for i, runs in segments.items() if runs}
        owners = Owners(comm, optimizer.orthogonalize_one, optimizer.ns_steps, redundant) \
            if whole and not split & set(names) else \
            Gathered(comm, optimizer.orthogonalize_one, optimizer.ns_steps, shapes,
                     {i: runs for i, runs in segments.items() if i in ids})
        parts.append((owners, ids))
    optimizer.orthogonalizer = parts[0][0] if len(parts) == 1 else Grouped(parts)
    return optimizer.orthogonalizer
