"""Checkpoints in one format for every strategy and world size (``torch.distributed.checkpoint``).

``checkpoints/step-NNNNNN/`` holds DCP's files (every rank's part and ``.metadata``) and
``meta.json`` (step, tokens, wall time, who wrote it), which rank 0 writes last, after every rank
has finished its part: a folder without it is incomplete and ignored. Folders are built under a
temporary name and renamed into place; a folder being replaced is moved aside first and deleted
only once its successor is in place.

Every parameter and each of its AdamW moments is stored as one flat tensor of the parameter's
size, ``model/NAME``, ``optim/NAME/exp_avg``, ``optim/NAME/exp_avg_sq``, plus the step counter
``optim/step``. Each rank writes the contiguous range of the flattened tensor it holds (the whole
tensor for a replicated strategy, its slice of a flat ZeRO unit, its rows under FSDP), and loading
asks for the ranges the loading strategy holds: DCP reads whichever saved pieces overlap them. A weight
that tensor parallelism cuts along its columns is stored in its own 2-D shape instead (``Blocks``): a
rank's shard is then one rectangle, where in the flattened tensor it is one range per row, and DCP's cost
grows with the pieces (tp 2 on 2 ranks, the demo's model: 6,475 pieces took 10.7-17.3 s a save, 379 take
1.0-1.8 s; benchmarks/checkpoint/README.md). Loading meets each entry in the shape it was stored in, so a flat
range reads from a 2-D entry (as at most three rectangles) and a rectangle from a flat one (checkpoints
written before, one range per row). So a run saved by zero3 on 2 ranks resumes under zero2 on 4, under
ddp, or under single on one process, and ``load_model`` rebuilds whole weights in a process with no group
at all (export, sampling).
Random state is not stored: the loop derives it from (seed, rank, step).
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import re
import shutil
import sys
import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lab.runtime.config import ConfigError
from lab.runtime import chaos
from lab.runtime.files import fsync_folder, read_json, read_plain, save_json

META = "meta.json"
FORMAT = 2
METADATA_MAX_BYTES = 2**30  # DCP's .metadata (an entry per tensor piece) larger than this is not read
# DCP reports a missing key, a truncated or a foreign file with several types; CheckpointException
# (raised when any rank failed) derives from BaseException, not Exception.
UNREADABLE = (Exception, dcp.CheckpointException)
_NAME = re.compile(r"step-(\d+)")
# What a save leaves when it is interrupted (``save``, ``_seal``): the only folders under checkpoints/ it removes
_LEFT = re.compile(r"step-\d+\.(tmp|old)")
# write_atomic's temporary files (``replacing``) beside a run's files: the only files of the run folder it removes
_RUN_TEMP = re.compile(r"\.(config\.json|summary\.json|metrics\.jsonl|config\.toml)(\.[A-Za-z0-9_]+)?\.tmp")
MAX_STEP = 10**9  # far beyond any run (ten steps a second for three years); a larger step is a crafted meta.json
# What DCP pickles into ``.metadata`` for a state of tensors; anything else (a callable, BytesStorageMetadata, whose
# entries DCP would unpickle without restriction) means a checkpoint this lab did not write.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
}


@dataclass(frozen=True)
class Held:
    """The range [lo, lo + len(view)) of a flattened tensor of ``numel`` elements that this rank holds.

    ``view`` is a live 1-D view into the strategy's own tensor: saving reads it, loading writes it.
    """

    numel: int
    lo: int
    view: torch.Tensor


@dataclass(frozen=True)
class Pieces:
    """Several ranges of a flattened tensor of ``numel`` elements that this rank holds, each ``(lo, view)``: a
    tensor-parallel shard of a weight cut along its columns, or in several blocks (a fused QKV), is one range
    per row or per block of the whole tensor."""

    numel: int
    pieces: list[tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class Blocks:
    """Rectangles of a 2-D tensor of ``shape`` that this rank holds, each ``(row, column, view)`` with ``view`` a live
    2-D view: a tensor-parallel shard of a weight cut along its columns is one (three at most when a data-parallel
    strategy holds a range of the shard). Stored in its 2-D shape."""

    shape: tuple[int, int]
    blocks: list[tuple[int, int, torch.Tensor]]


# what a strategy hands over; plain tensors are whole
CheckpointState = dict[str, "Held | Pieces | Blocks | torch.Tensor"]


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The common part ``(lo, hi)`` of the ranges ``a`` and ``b`` (``lo >= hi``: none)."""
    return max(a[0], b[0]), min(a[1], b[1])


def row_blocks(width: int, lo: int, view: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """Elements [lo, lo + len(view)) of a row-major 2-D tensor ``width`` wide as at most three rectangles ``(row,
    column, 2-D view)``: the rest of the first row, the whole rows, the start of the last."""
    hi = lo + view.numel()
    first_whole, last_whole = min(-(-lo // width) * width, hi), max(hi // width * width, lo)
    cuts, out = sorted({lo, first_whole, last_whole, hi}), []
    for a, b in zip(cuts, cuts[1:]):
        row, column = divmod(a, width)
        rows = (b - a) // width if column == 0 and (b - a) % width == 0 else 1
        out.append((row, column, view[a - lo:b - lo].view(rows, (b - a) // rows)))
    return out


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that one process means no process group even when that is asked for; and ShardedTensor
    is marked for DTensor's sake, which cannot place an arbitrary range of a flattened tensor (its
    offsets follow its placements) while ShardedTensor can, and DCP reads and writes it natively."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*ShardedTensor")
        yield


def _to_dcp(state: CheckpointState, rank: int, stored: dict[str, torch.Size] | None = None) -> dict[str, object]:
    """Plain tensors as they are; partial ranges and blocks as sharded tensors that say where their pieces sit. Each
    entry takes the shape ``stored`` gives it (a load's checkpoint), else its own (flat; ``Blocks`` 2-D)."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    out: dict[str, object] = {}
    with _quiet():
        for key, value in state.items():
            shape = tuple(stored[key]) if stored is not None and key in stored else None
            if shape is not None and math.prod(shape) != _numel(value):
                shape = None  # another model's: DCP names the mismatch
            if isinstance(value, torch.Tensor):
                out[key] = value if shape is None or value.shape == shape else value.view(shape)
                continue
            size, pieces = _placed(value, shape)
            shards = [Shard.from_tensor_and_offsets(view, list(at), rank) for at, view in pieces if view.numel()]
            out[key] = init_from_local_shards(shards, *size)
    return out


def _numel(value: Held | Pieces | Blocks | torch.Tensor) -> int:
    """Elements of the whole tensor ``value`` is (part of)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    return math.prod(value.shape) if isinstance(value, Blocks) else value.numel


def _placed(value: Held | Pieces | Blocks, shape: tuple[int, ...] | None
            ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]:
    """The size of the tensor ``value`` is part of, in ``shape`` (or its own), and its pieces as (offsets, view)."""
    if isinstance(value, Blocks):
        if shape is None or len(shape) == 2:
            return value.shape, [((row, column), view) for row, column, view in value.blocks]
        width = value.shape[1]  # stored flat (before 2-D blocks, or by a strategy without tp): one range per row
        return shape, [(((row + i) * width + column,), line) for row, column, view in value.blocks
                       for i, line in enumerate(view)]
    ranges = value.pieces if isinstance(value, Pieces) else [(value.lo, value.view)]
    if shape is not None and len(shape) == 2:  # ranges of a tensor stored in its 2-D shape
        return shape, [((row, column), view) for lo, flat in ranges
                       for row, column, view in row_blocks(shape[1], lo, flat)]
    return (value.numel,), [((lo,), view) for lo, view in ranges]


# ---------------------------------------------------------------- the folders


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first. A folder moved aside for a replacement (``step-N.old``)
    still counts when the process died before its successor took its name."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name.endswith(".old")):
        match = _NAME.fullmatch(p.name.removesuffix(".old"))
        if match and (p / META).is_file():
            done.setdefault(int(match.group(1)), p)
    return [done[step] for step in sorted(done)]


def latest(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def latest_readable(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose metadata (meta.json and DCP's ``.metadata``) reads; each newer one
    that does not is passed over with a warning on stderr, and when none reads the newest one's error is raised.
    A crafted one (ForeignCheckpoint) is refused, never passed over."""
    passed_over: list[ConfigError] = []
    for folder in reversed(checkpoint_dirs(run_dir)):
        try:
            read_meta(folder)
            read_dcp_metadata(folder)
        except ForeignCheckpoint:
            raise
        except ConfigError as e:
            passed_over.append(e)
            continue
        for e in passed_over:
            print(f"warning: {e}; resuming from {folder.name} instead", file=sys.stderr, flush=True)
        return folder
    if passed_over:
        raise passed_over[0]
    return None


def digest(folder: Path) -> str:
    """A digest of a checkpoint's metadata (meta.json and ``.metadata``): ranks compare it before loading."""
    h = hashlib.sha256()
    for name in (META, ".metadata"):
        try:
            h.update(read_plain(folder / name, METADATA_MAX_BYTES, follow=False))
        except OSError as e:
            h.update(f"unreadable: {e.strerror}".encode())
    return h.hexdigest()


def clean_stale_temporaries(run_dir: Path) -> None:
    """Remove what an interrupted run left half-written: checkpoint folders under construction or
    moved aside, and temporary files beside the run's JSON files."""
    root, complete = run_dir / "checkpoints", set(checkpoint_dirs(run_dir))
    for p in root.iterdir() if root.is_dir() else []:
        if _LEFT.fullmatch(p.name) and p.is_dir() and not p.is_symlink() and p not in complete:
            shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.glob(".*.tmp"):
        if _RUN_TEMP.fullmatch(p.name):
            p.unlink(missing_ok=True)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


# ---------------------------------------------------------------- save and load

ONE_FILE_MAX_BYTES = 64 * 2**20  # a rank's state up to this size is written as one file


def _tensor_bytes(tree: object) -> int:
    """Bytes this rank holds in the tensors of ``tree`` (a sharded tensor's local shards, a DTensor's local part)."""
    def local(t: torch.Tensor) -> list[torch.Tensor]:
        if hasattr(t, "local_shards"):
            return [shard.tensor for shard in t.local_shards()]
        return [t.to_local() if hasattr(t, "to_local") else t]

    return sum(p.numel() * p.element_size() for t in torch.utils._pytree.tree_leaves(tree)
               if isinstance(t, torch.Tensor) for p in local(t))



def save(run_dir: Path, step: int, rank: int, world_size: int, state: CheckpointState, meta: dict,
         keep: int, pinned: Collection[int] = ()) -> Path:
    """Write every rank's part of ``step``; rank 0 seals the folder and prunes old ones but those of ``pinned``
    steps (collective)."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.parent.is_dir():
            final.parent.mkdir(parents=True)
            fsync_folder(run_dir)
        tmp.mkdir()
    _barrier(world_size)
    try:
        with _quiet():
            # A large state goes one file per tensor: DCP clones a range (a sharded strategy's view) before writing
            # it and keeps every clone until its file is closed, which in one file per rank is a second copy of the
            # rank's whole state. A small one goes in one file: dozens of files (each synced) per save cost more.
            flat = _to_dcp(state, rank)
            per_tensor = _tensor_bytes(flat) > ONE_FILE_MAX_BYTES
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=not per_tensor),
                     no_dist=world_size == 1)  # each file synced
        chaos.point("checkpoint-write")
        _barrier(world_size)
        if rank == 0:
            _seal(run_dir, tmp, final, {**meta, "format": FORMAT, "step": step, "world_size": world_size}, keep,
                  pinned)
    except (OSError, dcp.CheckpointException) as e:  # a full disk or quota, on any rank (DCP tells every rank)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest(run_dir)
        raise CheckpointWriteError(f"checkpoint {final.name} could not be written ({_reason(e)}); the run stopped "
                                   f"and {previous.name if previous else 'no earlier checkpoint'} is kept: "
                                   f"free space, then resume") from None
    _barrier(world_size)
    return final


def _seal(run_dir: Path, tmp: Path, final: Path, meta: dict, keep: int, pinned: Collection[int]) -> None:
    """Rank 0: write meta.json into the finished folder (which syncs the folder's entries), move it into place and
    sync that, then prune old ones (the newest ``keep`` and those of ``pinned`` steps stay)."""
    save_json(tmp / META, meta)
    aside = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        final.replace(aside)
    tmp.replace(final)
    fsync_folder(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    prunable = [d for d in checkpoint_dirs(run_dir) if step_of(d) not in pinned]
    for old in prunable[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def step_of(folder: Path) -> int:
    """The step of a checkpoint folder (``step-NNNNNN``, or one moved aside as ``step-NNNNNN.old``)."""
    return int(_NAME.fullmatch(folder.name.removesuffix(".old")).group(1))


def read_meta(folder: Path) -> dict:
    """A checkpoint's meta.json; ConfigError (one line) when it is missing, unreadable or of another format,
    ForeignCheckpoint when it is a symbolic link (never followed)."""
    if (folder / META).is_symlink():
        raise ForeignCheckpoint(f"checkpoint {folder} is refused: its {META} is a symbolic link")
    try:
        meta = read_json(folder / META)
        if not isinstance(meta.get("step"), int) or meta.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} checkpoint")
        if not 0 <= meta["step"] <= MAX_STEP:
            raise ValueError(f"its step {meta['step']:,} is not one of a run (0 to {MAX_STEP:,})")
        return meta
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"checkpoint {folder} is unreadable ({META}: {e})") from None


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk); the message is one line and names the one kept."""


class ForeignCheckpoint(ConfigError):
    """A checkpoint whose metadata holds what this lab never writes (a crafted folder): refused, never skipped."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and refuses every global outside the types DCP writes (and torch's dtypes)."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise ForeignCheckpoint(f"its .metadata asks for {module}.{name}, which is not a type DCP writes")


def read_dcp_metadata(folder: Path) -> object:
    """DCP's ``.metadata`` of ``folder``, read through the allow-list: ConfigError (one line) when it is missing
    or unreadable, ForeignCheckpoint when it holds anything else, is not a plain file or names a data file that is
    not a plain file of the folder. Nothing in it is executed, and nothing outside the folder is opened."""
    path = folder / ".metadata"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ForeignCheckpoint(f"checkpoint {folder} is refused: its .metadata is not a plain file")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(read_plain(path, METADATA_MAX_BYTES, follow=False))).load()
    except ForeignCheckpoint as e:
        raise ForeignCheckpoint(f"checkpoint {folder} is refused: {e}") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise ConfigError(f"checkpoint {folder} is unreadable (.metadata: {e})") from None
    if type(metadata).__name__ != "Metadata":
        raise ForeignCheckpoint(f"checkpoint {folder} is refused: its .metadata holds a {type(metadata).__name__}, "
                                f"not DCP's Metadata")
    _check_data_files(folder, metadata)
    return metadata


def _check_data_files(folder: Path, metadata: object) -> None:
    """ForeignCheckpoint unless every data file ``metadata`` names is a plain file directly in ``folder``."""
    storage = getattr(metadata, "storage_data", None) or {}
    for name in {getattr(info, "relative_path", None) for info in storage.values()}:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ForeignCheckpoint(f"checkpoint {folder} is refused: its .metadata names the data file {name!r}, "
                                    f"which is not a file of the folder")
        file = folder / name
        if file.is_symlink() or (file.exists() and not file.is_file()):
            raise ForeignCheckpoint(f"checkpoint {folder} is refused: its data file {name} is not a plain file")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list (tensors it loads with weights_only)."""

    def read_metadata(self, *args: object, **kwargs: object) -> object:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _stored_sizes(folder: Path) -> dict[str, torch.Size]:
    """The size each tensor entry of ``folder`` was stored in (read through the allow-list: refused in one line)."""
    entries = read_dcp_metadata(folder).state_dict_metadata
    return {key: md.size for key, md in entries.items() if hasattr(md, "size")}


def _reason(e: BaseException) -> str:
    """The last line of an error (DCP's carry every rank's traceback), shortened."""
    lines = str(e).strip().splitlines()
    return (lines[-1] if lines else type(e).__name__)[:200]


def load(folder: Path, rank: int, world_size: int, state: CheckpointState) -> dict:
    """Fill ``state``'s views from ``folder`` (collective; any saving world size or strategy); return its meta."""
    meta = read_meta(folder)
    stored = _stored_sizes(folder)  # a crafted or unreadable one is refused in one line, before DCP reads it again
    try:
        with _quiet():
            dcp.load(_to_dcp(state, rank, stored), storage_reader=_SafeReader(folder), no_dist=world_size == 1)
    except UNREADABLE as e:
        raise ConfigError(f"checkpoint {folder} is unreadable ({_reason(e)}); "
                          "delete it to use an earlier one") from None
    return meta


def load_model(folder: Path, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Whole weights of ``shapes`` (name → shape) from any checkpoint, in this process alone, on the CPU."""
    read_meta(folder)
    stored = _stored_sizes(folder)
    flat = {f"model/{name}": torch.empty(math.prod(shape)) for name, shape in shapes.items()}
    try:
        with _quiet():
            dcp.load(_to_dcp(flat, 0, stored), storage_reader=_SafeReader(folder), no_dist=True)
    except UNREADABLE as e:
        raise ConfigError(f"checkpoint {folder} is unreadable ({_reason(e)})") from None
    return {name: flat[f"model/{name}"].view(shape) for name, shape in shapes.items()}


def load_everything(folder: Path) -> dict[str, torch.Tensor]:
    """Every entry of a checkpoint, whole and flat (weights, moments, steps; a 2-D one flattened), in this process
    alone."""
    read_meta(folder)
    stored = read_dcp_metadata(folder).state_dict_metadata
    out = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in stored.items() if hasattr(md, "size")}
    with _quiet():
        dcp.load(out, storage_reader=_SafeReader(folder), no_dist=True)
    return {key: value.flatten() if value.dim() > 1 else value for key, value in out.items()}
