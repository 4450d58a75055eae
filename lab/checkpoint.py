"""Checkpoints as ``checkpoints/step-NNNNNN/`` folders, written atomically, loaded weights-only.

A folder holds ``rank-K.pt`` per rank (strategy state: model and optimizer, RNG states) and
``meta.json`` (step, tokens, world size), which is written last: a folder without it is
incomplete and ignored. Folders are built under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from lab.config import save_json

META = "meta.json"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / META).is_file() and not p.name.endswith(".tmp")]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


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
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
        for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    _barrier(world_size)
    return final


def load(folder: Path, rank: int, world_size: int) -> tuple[dict, dict]:
    """This rank's state and the folder's meta; restores RNG states."""
    meta = json.loads((folder / META).read_text())
    if meta["world_size"] != world_size:
        raise ValueError(f"checkpoint {folder} was written by {meta['world_size']} processes; "
                         f"resume it with the same world size (got {world_size})")
    state = torch.load(folder / f"rank-{rank}.pt", map_location="cpu", weights_only=True)
    set_rng_state(state["rng"])
    return state, meta
