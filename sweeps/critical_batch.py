"""The batch sweep's runs (``[critical_batch]``): sizes x batches x learning rates, each long enough for every target.

For each size of ``sizes`` (the grid the analysis fits) and of ``held_out.sizes`` (trained to test the law the grid
gives), every batch B of ``batch_tokens`` is trained at the rates f x lr(B) x lr_size(N), f in ``lr_factors``, with
``lr`` a power rule of the batch and ``lr_size`` one of the size N (the held-out sizes' own ``lr_factors`` if
given). A run trains ``tokens + steps x B`` tokens (rounded to whole batches): the frontier's shape E(B) = E_min +
S_min B, so that one margin above the lowest target's E_min and S_min serves every batch. The schedule is constant
after ``warmup_steps`` steps (each run's ``train.warmup`` is that share of its own steps), so the steps to a target
do not depend on where a decay starts; each batch is one micro-step (``train.micro_batch`` = B / context, at most
``MAX_MICRO_BATCH`` sequences), and the held-out loss is logged ``[sweep] evals`` times, evenly in steps, the curve
the analysis reads steps and tokens to each target from (``python -m analysis critical-batch``).

Held-out runs are named ``heldout-...``; ``MANIFEST`` in the sweep folder (written by ``run``) names each run's part
and the targets, for the analysis.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lab.measure import accounting
from lab.runtime.files import save_json

from sweeps.runs import PlannedRun, family_shapes, planned_run
from sweeps.shapes import count, model_config
from sweeps.sweep import Sweep

MANIFEST = "critical_batch.json"
MAX_MICRO_BATCH = 128  # sequences per micro-step; a larger batch accumulates
HELD_OUT = "held-out"
GRID = "grid"


def _parts(sweep: Sweep) -> list[tuple[str, tuple[float, ...], float, int, tuple[float, ...]]]:
    """(part, sizes, tokens, steps, rate factors) of the grid and the held-out sizes."""
    cb = sweep.critical_batch
    parts = [(GRID, cb.sizes, cb.tokens, cb.steps, cb.lr_factors)]
    if cb.held_out is not None:
        held = cb.held_out
        parts.append((HELD_OUT, held.sizes, held.tokens or cb.tokens, held.steps or cb.steps,
                      held.lr_factors or cb.lr_factors))
    return parts


def _with_train(sweep: Sweep, **train: object) -> Sweep:
    """``sweep`` whose ``[base.train]`` also sets ``train``."""
    base = {**sweep.base, "train": {**sweep.base.get("train", {}), **train}}
    return dataclasses.replace(sweep, base=base)


def _run(sweep: Sweep, part: str, shape_name: str, target: float, shape: dict, entry_launch: dict, batch: float,
         lr: float, tokens: float, steps: int, seed: int | None) -> PlannedRun | str:
    """One run of the batch sweep, or the line refusing it."""
    cfg = model_config(sweep.base, shape)
    micro = max(1, min(MAX_MICRO_BATCH, round(batch / cfg.block_size)))
    wanted = tokens + steps * batch
    total = max(1, round(wanted / batch))
    warmup = sweep.critical_batch.warmup_steps
    if warmup >= total:
        return f"{part} size {target:.3g}, batch {batch:g}: {total} steps leave no room for {warmup} warmup steps"
    prefix = "heldout-" if part == HELD_OUT else ""
    return planned_run(_with_train(sweep, micro_batch=micro, warmup=warmup / total), accounting.flops_per_token(cfg)
                       * wanted, shape_name, target, shape, entry_launch, lr=lr, batch_tokens=batch,
                       name=f"{prefix}{shape_name}-B{batch:g}-lr{lr:.3g}", seed=seed)


def runs(sweep: Sweep) -> tuple[list[PlannedRun], list[str]]:
    """Every run of the batch sweep (grid, then held-out) and one refusal line per run that cannot be planned."""
    cb = sweep.critical_batch
    out: list[PlannedRun] = []
    refused: list[str] = []
    grid_shapes: set[str] = set()
    for part, sizes, tokens, steps, factors in _parts(sweep):
        shapes, part_refused, repeats = family_shapes(sweep, list(sizes), f"[critical_batch] {part}, ")
        refused += part_refused + repeats
        for shape_name, target, shape, entry_launch in shapes:
            size_factor = cb.lr_size.at(count(model_config(sweep.base, shape), sweep.count))
            if part == HELD_OUT and shape_name in grid_shapes:
                refused.append(f"[critical_batch] held-out size {target:.3g} gives {shape_name}, a shape of the grid")
                continue
            grid_shapes.add(shape_name)
            for batch in cb.batch_tokens:
                for factor in factors:
                    lr = float(f"{factor * cb.lr.at(batch) * size_factor:.4g}")
                    for seed in sweep.seeds or (None,):
                        run = _run(sweep, part, shape_name, target, shape, entry_launch, batch, lr, tokens, steps,
                                   seed)
                        (refused if isinstance(run, str) else out).append(run)
    return out, refused


def describe(sweep: Sweep) -> list[str]:
    """What ``plan`` prints about the batch sweep: its design in one line per part."""
    cb, planned = sweep.critical_batch, runs(sweep)[0]
    batches = cb.batch_tokens
    lines = []
    for part, sizes, tokens, steps, factors in _parts(sweep):
        mine = [r for r in planned if r.name.startswith("heldout-") == (part == HELD_OUT)]
        targets = cb.held_out.targets if part == HELD_OUT else cb.targets
        shapes = sorted({r.params for r in mine})
        lines.append(f"{part}: {len(shapes)} size(s) ({', '.join(f'{n:,}' for n in shapes)} parameters) x "
                     f"{len(batches)} batches {batches[0]:g}-{batches[-1]:g} tokens ({batches[-1] / batches[0]:.3g}x) "
                     f"x {len(factors)} rate(s) ({', '.join(f'{f:g}' for f in factors)}) = {len(mine)} runs of "
                     f"{tokens:.3g} + {steps} x B tokens; targets {', '.join(f'{t:g}' for t in targets)}")
    lines.append(f"lr = {cb.lr.value:g} x (B / {cb.lr.reference:g})^{cb.lr.exponent:g} x (N / "
                 f"{cb.lr_size.reference:g})^{cb.lr_size.exponent:g} times each part's factors; constant after "
                 f"{cb.warmup_steps} warmup steps")
    return lines


def manifest(sweep: Sweep) -> dict:
    """What the analysis needs from the design: the targets of each part and each run's part."""
    cb, planned = sweep.critical_batch, runs(sweep)[0]
    return {"targets": list(cb.targets), "held_out_targets": list(cb.held_out.targets) if cb.held_out else [],
            "runs": {r.name: HELD_OUT if r.name.startswith("heldout-") else GRID for r in planned}}


def write_manifest(folder: Path, sweep: Sweep) -> None:
    """``MANIFEST`` in the sweep folder, atomically."""
    save_json(folder / MANIFEST, manifest(sweep))

