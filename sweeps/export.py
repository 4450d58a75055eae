"""The results table: one row per finished run, in the columns ``python -m analysis fit`` reads unmapped."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from sweeps.registry import Row

FORMATS = (".csv", ".parquet")


def results(rows: list[Row], roles: tuple[str, ...] = ("sweep",)) -> pd.DataFrame:
    """Finished runs of the given roles (the sweep's own; ``search`` and ``verify`` runs on request) as a table:
    ``params``, ``params_non_embedding``, ``tokens``, ``flops``, ``loss`` (the final eval loss, else the final
    train loss) and the run's other figures."""
    records = []
    for row in rows:
        if row.status != "done" or row.summary is None or row.plan.role not in roles:
            continue
        s, p = row.summary, row.plan
        loss = s.get("final_eval_loss") if s.get("final_eval_loss") is not None else s.get("final_train_loss")
        records.append({
            "run_id": row.name, "params": s["params"], "params_non_embedding": s["params_non_embedding"],
            "tokens": s["tokens"], "flops": s["flops"], "loss": loss,
            "final_eval_loss": s.get("final_eval_loss"), "final_train_loss": s.get("final_train_loss"),
            "budget": p.budget, "flops_per_token": s.get("flops_per_token"), "n_layer": p.shape["n_layer"],
            "d_model": p.shape["d_model"], "n_head": p.shape["n_head"], "lr": p.lr, "batch_tokens": p.batch_tokens,
            "strategy": s.get("strategy"), "world_size": s.get("world_size"), "wall_time_s": s.get("wall_time_s"),
            "steps": s.get("steps"), "config_hash": row.config_hash, "run_dir": str(row.run_dir), "role": p.role,
        })
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
