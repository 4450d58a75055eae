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
from lab.parallel.holding import Piece
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
    sharding strategy's: flat chunks cut across matrices, or rows). ``matrices``: every matrix's shape, in one order
    on every rank; ``segments``: for each tensor this rank steps (by id), the (matrix, lo, hi, at) of each run of one
    matrix's flattened elements [lo, hi) it holds from its own flattened element ``at`` on.

    A step sends each segment's update (bf16, what the iteration reads) to its matrix's owner in one all-to-all, the
    owner assembles and orthogonalizes the matrix, and a second all-to-all sends each segment its part of the result:
    each rank sends the elements it holds of matrices it does not own, and back the elements others hold of those it
    owns. Who holds what is exchanged once, at the first step."""

    def __init__(self, comm: Comm, orthogonalize: Callable[[torch.Tensor], torch.Tensor], ns_steps: int,
                 matrices: list[tuple[int, int]], segments: dict[int, list[tuple[int, int, int, int]]]):
        super().__init__(comm, orthogonalize, ns_steps)
        self.redundant = False
        self.shapes, self.segments = [tuple(s) for s in matrices], segments
        self.owners = assign_owners([newton_schulz_flops(s, ns_steps) for s in self.shapes], comm.world_size)
        self.held: list[list[tuple[int, int, int]]] | None = None  # every rank's (matrix, lo, hi), in sending order

    def _plan(self, updates: list[torch.Tensor]) -> None:
        """Who holds what: every rank's segments, in the order it sends them (by owner, then as it holds them)."""
        if self.held is None:
            mine = sorted((m, lo, hi) for runs in self.segments.values() for m, lo, hi, _ in runs)
            mine.sort(key=lambda run: self.owners[run[0]])  # stable: by owner, then as held
            self.held = [mine] * self.comm.world_size
            if self.comm.world_size > 1:
                dist.all_gather_object(self.held, mine, group=self.comm.group)

    def __call__(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[list[Part]]:
        self._plan(updates)
        t0 = time.perf_counter()
        self.last = {"muon_sent_bytes": 0.0, "muon_orthogonalized": 0, "muon_s": 0.0}
        rank, n = self.comm.rank, self.comm.world_size
        runs = {}  # (matrix, lo) -> (tensor index, at, hi)
        for i, t in enumerate(tensors):
            for m, lo, hi, at in self.segments[id(t)]:
                runs[m, lo] = (i, at, hi)
        flats = [(u.to_local() if hasattr(u, "to_local") else u).reshape(-1) for u in updates]
        order = self.held[rank]
        send = [flats[runs[m, lo][0]][runs[m, lo][1]:runs[m, lo][1] + hi - lo] for m, lo, hi in order]
        split = [sum(hi - lo for m, lo, hi in order if self.owners[m] == d) for d in range(n)]
        back = self._exchange_pieces(torch.cat(send).bfloat16() if send else torch.empty(0, dtype=torch.bfloat16),
                                     split, self._assemble_and_orthogonalize)
        parts: list[list[Part]] = [[] for _ in tensors]
        taken = 0
        for m, lo, hi in order:
            i, at, _ = runs[m, lo]
            parts[i].append((slice(at, at + hi - lo), back[taken:taken + hi - lo], rms_scale(self.shapes[m])))
            taken += hi - lo
        self.last["muon_s"] = time.perf_counter() - t0
        return parts

    def _exchange_pieces(self, send: torch.Tensor, split: list[int],
                         orthogonalized: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Send ``send`` (``split`` elements to each rank) to the owners, turn what arrives into its orthogonalized
        counterpart (``orthogonalized``), and send that back the reverse way."""
        rank, n = self.comm.rank, self.comm.world_size
        arriving = [sum(hi - lo for m, lo, hi in self.held[s] if self.owners[m] == rank) for s in range(n)]
        received = self._all_to_all(send, split, arriving)
        return self._all_to_all(orthogonalized(received), arriving, split)

    def _all_to_all(self, send: torch.Tensor, split: list[int], arriving: list[int]) -> torch.Tensor:
        """``send`` cut by ``split`` to each rank; what arrives (``arriving`` from each), in rank order. Counts the
        bytes sent to other ranks."""
        out = send.new_empty(sum(arriving))
        self.last["muon_sent_bytes"] += (sum(split) - split[self.comm.rank]) * send.element_size()
        dist.all_to_all_single(out, send, arriving, split, group=self.comm.group)
        return out

    def theory_bytes(self) -> float:
        """Bytes this rank sends a step, bf16: the elements it holds of matrices others own, and back the elements
        others hold of those it owns."""
        if self.held is None:
            return 0.0
        rank = self.comm.rank
        out = sum(hi - lo for m, lo, hi in self.held[rank] if self.owners[m] != rank)
        back = sum(hi - lo for s, held in enumerate(self.held) if s != rank for m, lo, hi in held
                   if self.owners[m] == rank)
        return 2.0 * (out + back)

    def _assemble_and_orthogonalize(self, received: torch.Tensor) -> torch.Tensor:
        """The owned matrices from every rank's pieces (in the order they came), orthogonalized, cut back into the
        same pieces."""
        rank = self.comm.rank
        pieces = [(s, m, lo, hi) for s in range(self.comm.world_size) for m, lo, hi in self.held[s]
                  if self.owners[m] == rank]
        whole = {m: received.new_empty(self.shapes[m][0] * self.shapes[m][1]) for m in {m for _, m, _, _ in pieces}}
        taken = 0
        for _, m, lo, hi in pieces:
            whole[m][lo:hi] = received[taken:taken + hi - lo]
            taken += hi - lo
        done = {m: self.orthogonalize(flat.view(self.shapes[m])).reshape(-1) for m, flat in whole.items()}
        self.last["muon_orthogonalized"] = len(done)
        return torch.cat([done[m][lo:hi] for _, m, lo, hi in pieces]) if pieces else received


class Grouped(Figures):
    """Several orthogonalizers, each over the ranks that share its matrices (the data axis's, an expert group's),
    called in one order on every rank; their figures added up (the load: the largest)."""

    line_place = Owners.line_place
    line = Owners.line

    def __init__(self, parts: list[tuple[Owners, set[int]]]):
        self.parts = parts  # each with the ids of the tensors it orthogonalizes

    def __call__(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[list[Part]]:
        out: list[list[Part]] = [[] for _ in tensors]
        for owners, ids in self.parts:
            mine = [i for i, t in enumerate(tensors) if id(t) in ids]
            for i, parts in zip(mine, owners([tensors[i] for i in mine], [updates[i] for i in mine]), strict=True):
                out[i] = parts
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


def locate(tensors: list[torch.Tensor], pieces: list[Piece], names: list[str]
           ) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int, int, int]]]]:
    """Each of ``names``' shape, and for each of ``tensors`` (an optimizer's, by id) the (matrix, lo, hi, at) of each
    run of a matrix's flattened elements [lo, hi) it holds from its own element ``at`` on: each piece (``Strategy.
    holding``) found in the tensor whose memory it lies in."""
    index = {name: i for i, name in enumerate(names)}
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    shapes: list[tuple[int, int]] = [(0, 0)] * len(names)
    segments: dict[int, list[tuple[int, int, int, int]]] = {id(t): [] for t in tensors}
    for piece in pieces:
        if piece.name not in index:
            continue
        shapes[index[piece.name]] = piece.shape
        value = piece.value
        for t, held in zip(tensors, local):
            at = (value.data_ptr() - held.data_ptr()) // value.element_size()
            if value.numel() and held.dtype == value.dtype and 0 <= at < held.numel():
                segments[id(t)].append((index[piece.name], piece.lo, piece.lo + value.numel(), at))
                break
    return shapes, segments


def distribute(optimizer: torch.optim.Optimizer, matrices: list[str], world_of: Callable[[str], World], whole: bool,
               redundant: bool, pieces: list[Piece]) -> Figures | None:
    """Set ``optimizer``'s orthogonalizer: for the ``matrices`` each world shares (``world_of``), owners over its
    ranks, of whole matrices every rank holds alike (``whole``) or of the pieces the ranks hold (``pieces``:
    ``Strategy.holding``). None, and nothing set, for an optimizer without one (AdamW)."""
    if not hasattr(optimizer, "orthogonalizer"):
        return None
    worlds: dict[int, tuple[World, list[str]]] = {}
    for name in matrices:
        world = world_of(name)
        worlds.setdefault(id(world.group), (world, []))[1].append(name)
    tensors = [t for g in optimizer.param_groups if g.get("muon") for t in g["params"]]
    parts: list[tuple[Owners, set[int]]] = []
    for world, names in worlds.values():
        shapes, segments = locate(tensors, pieces, names)
        comm = Comm(world.world_size, world.group, axis="dp")
        ids = {i for i, runs in segments.items() if runs}
        owners = Owners(comm, optimizer.orthogonalize_one, optimizer.ns_steps, redundant) if whole else \
            Gathered(comm, optimizer.orthogonalize_one, optimizer.ns_steps, shapes,
                     {i: runs for i, runs in segments.items() if i in ids})
        parts.append((owners, ids))
    optimizer.orthogonalizer = parts[0][0] if len(parts) == 1 else Grouped(parts)
    return optimizer.orthogonalizer
