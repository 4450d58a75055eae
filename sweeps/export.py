"""The results table: one row per finished experiment, in the columns ``python -m analysis fit`` reads unmapped.

Strategy twins, runs whose options differ only in ``--parallel.*`` (how a run is spread over
processes, not what it computes) and in their process count, are one experiment: the first
finished one gives the row and the others are named in its ``twins`` column, so that the analysis
does not count one experiment twice. Seed replicates, runs whose options differ only in ``--train.seed``, are
separate rows that share an ``experiment`` column: the analysis averages them where it takes one loss per size
(``analysis.akima``) and does not warn about them as unexplained duplicates.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pandas as pd

from lab.runtime.scores import task_columns
from sweeps.registry import Row

FORMATS = (".csv", ".parquet")


def experiment_hash(row: Row, seed: bool = True) -> str:
    """Identity of what a run computes: its options without the ``--parallel.*`` ones (its config hash also
    covers those and the process count), and its role (a search run is not a sweep run's twin); with ``seed``
    false, without ``--train.seed`` too (the identity its seed replicates share)."""
    args = row.plan.args
    kept = [pair for pair in zip(args[::2], args[1::2])
            if not pair[0].startswith("--parallel.") and (seed or pair[0] != "--train.seed")]
    return hashlib.sha256(json.dumps([row.plan.role, kept]).encode()).hexdigest()[:16]


def results(rows: list[Row], roles: tuple[str, ...] = ("sweep",)) -> pd.DataFrame:
    """Finished experiments of the given roles (the sweep's own; ``search`` and ``verify`` runs on request) as a
    table: ``params``, ``params_non_embedding``, ``tokens``, ``flops``, ``loss`` (the final eval loss, else the
    final train loss), the run's other figures, its ``role``, its strategy ``twins`` and the ``experiment`` its
    seed replicates share, a cooldown branch's
    ``parent`` and ``branch_step`` (empty and 0 for a run of its own), ``flops_spent`` (what the run itself spent:
    a branch's ``flops`` also counts its parent's steps before the branch), and a ``task_NAME`` column per
    downstream task scored by ``python -m lab eval``."""
    records = []
    by_experiment: dict[str, dict] = {}
    for row in rows:
        if row.status != "done" or row.summary is None or row.plan.role not in roles:
            continue
        first = by_experiment.get(experiment_hash(row))
        if first is not None:
            first["twins"] = ";".join(filter(None, (first["twins"], row.name)))
            continue
        s, p = row.summary, row.plan
        loss = row.final_loss
        records.append({
            "run_id": row.name, "params": s["params"], "params_non_embedding": s["params_non_embedding"],
            "params_active": s.get("params_active", s["params"]), "moe_experts": s.get("moe_experts", 0),
            "moe_top_k": s.get("moe_top_k", 1), "moe_granularity": s.get("moe_granularity", 1),
            "tokens": s["tokens"], "flops": s["flops"], "loss": loss,
            "final_eval_loss": s.get("final_eval_loss"), "final_train_loss": s.get("final_train_loss"),
            "budget": p.budget, "flops_per_token": s.get("flops_per_token"), "n_layer": p.shape["n_layer"],
            "d_model": p.shape["d_model"], "n_head": p.shape["n_head"], "lr": p.lr, "batch_tokens": p.batch_tokens,
            "strategy": s.get("strategy"), "world_size": s.get("world_size"), "wall_time_s": s.get("wall_time_s"),
            "steps": s.get("steps"), "config_hash": row.config_hash, "run_dir": str(row.run_dir), "role": p.role,
            "twins": "", "experiment": experiment_hash(row, seed=False), "parent": p.parent or "",
            "branch_step": p.branch_step,
            "flops_spent": s["flops"] - p.branch_step * p.batch_tokens * p.flops_per_token,
            **task_columns(row.run_dir),
        })
        by_experiment[experiment_hash(row)] = records[-1]
    return pd.DataFrame.from_records(records)


def write(table: pd.DataFrame, out: Path) -> None:
    """Write CSV or Parquet (by suffix) under a temporary name, then rename it into place."""
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--out must end in {' or '.join(FORMATS)}, got '{out.name}'")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if suffix == ".csv":
            table.to_csv(tmp, index=False)
        else:
            table.to_parquet(tmp, index=False)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
