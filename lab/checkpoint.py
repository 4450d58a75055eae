"""Checkpoints as ``checkpoints/step-NNNNNN/`` folders, written atomically, loaded weights-only.

A folder holds ``rank-K.pt`` per rank (strategy state: model and optimizer, RNG states) and
``meta.json`` (step, tokens, world size), which is written last: a folder without it is
incomplete and ignored. Folders are built under a temporary name and renamed into place; a folder
being replaced is moved aside first and deleted only once its successor is in place.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from lab.config import ConfigError
from lab.files import save_json

META = "meta.json"
_NAME = re.compile(r"step-(\d+)")


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


def clean_stale_temporaries(run_dir: Path) -> None:
    """Remove what an interrupted run left half-written: checkpoint folders under construction or
    moved aside, and temporary files beside the run's JSON files."""
    root, complete = run_dir / "checkpoints", set(checkpoint_dirs(run_dir))
    for p in root.iterdir() if root.is_dir() else []:
        if p.is_dir() and not _NAME.fullmatch(p.name) and p not in complete:
            shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.glob(".*.tmp"):
        p.unlink(missing_ok=True)


def latest(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def save(run_dir: Path, step: int, rank: int, world_size: int, state: dict, meta: dict, keep: int) -> Path:
    """Write this rank's state for ``step``; rank 0 seals the folder and prunes old ones."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world_size)
    part = tmp / f"rank-{rank}.pt"
    torch.save({**state, "rng": rng_state()}, part.with_suffix(".pt.part"))
    part.with_suffix(".pt.part").replace(part)
    _barrier(world_size)
    if rank == 0:
        save_json(tmp / META, {**meta, "step": step, "world_size": world_size})
        aside = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            final.replace(aside)
        tmp.replace(final)
        shutil.rmtree(aside, ignore_errors=True)
        for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    _barrier(world_size)
    return final


def read_meta(folder: Path) -> dict:
    """A checkpoint's meta.json; ConfigError (one line) when it is missing or unreadable."""
    try:
        meta = json.loads((folder / META).read_text())
        if not isinstance(meta.get("step"), int) or not isinstance(meta.get("world_size"), int):
            raise ValueError("no step or world size")
        return meta
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"checkpoint {folder} is unreadable ({META}: {e}); delete it to use an earlier one") from None


def load_file(path: Path) -> dict:
    """One rank's state file, weights only; ConfigError (one line) when it is missing or corrupt."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"checkpoint file {path} is unreadable ({reason}); delete its folder to use an "
                          f"earlier checkpoint") from None


def load(folder: Path, rank: int, world_size: int) -> tuple[dict, dict]:
    """This rank's state and the folder's meta; restores RNG states."""
    meta = read_meta(folder)
    if meta["world_size"] != world_size:
        raise ConfigError(f"checkpoint {folder} was written by {meta['world_size']} processes; "
                          f"resume it with the same world size (got {world_size})")
    state = load_file(folder / f"rank-{rank}.pt")
    set_rng_state(state["rng"])
    return state, meta
