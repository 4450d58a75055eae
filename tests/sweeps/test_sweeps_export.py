"""The export collapses strategy twins (the same experiment on another strategy or process count) into one row."""

from __future__ import annotations

from pathlib import Path

from sweeps.export import results
from sweeps.runs import PlannedRun
from sweeps.registry import Row
from sweeps.spec import Launch


def _row(name: str, strategy: str, nproc: int, d_model: int, loss: float, seed: int | None = None) -> Row:
    args = ("--model.d_model", str(d_model), "--parallel.strategy", strategy, "--train.tokens", "1000")
    args += () if seed is None else ("--train.seed", str(seed))
    plan = PlannedRun(name=name, budget=1e9, target=None, shape={"n_layer": 2, "d_model": d_model, "n_head": 2},
                      params=1000 * d_model, params_non_embedding=900 * d_model, flops_per_token=6e3 * d_model,
                      tokens=1000, batch_tokens=100, lr=1e-2, launch=Launch(strategy=strategy, nproc=nproc),
                      args=args, est_seconds=1.0)
    summary = {"params": plan.params, "params_non_embedding": plan.params_non_embedding, "tokens": 1000,
               "flops": plan.flops, "final_eval_loss": loss, "final_train_loss": loss + 0.1, "strategy": strategy,
               "world_size": nproc}
    return Row(name=name, config_hash=plan.config_hash, status="done", run_dir=Path(name), plan=plan, attempts=1,
               job=None, error=None, summary=summary)


def test_strategy_twins_are_one_row_naming_the_others():
    rows = [_row("small", "single", 1, 32, 3.0), _row("small-ddp2", "ddp", 2, 32, 3.001),
            _row("small-zero2", "zero2", 2, 32, 3.002), _row("wide", "single", 1, 64, 2.5)]
    assert len({r.config_hash for r in rows}) == 4  # the registry's identity tells them apart
    table = results(rows)
    assert list(table["run_id"]) == ["small", "wide"]
    assert list(table["twins"]) == ["small-ddp2;small-zero2", ""]
    assert list(table["loss"]) == [3.0, 2.5]  # the first finished twin's own figures, not a blend


def test_seed_replicates_are_rows_of_their_own_sharing_one_experiment():
    rows = [_row("small", "single", 1, 32, 3.0), _row("small-s1", "single", 1, 32, 3.05, seed=1),
            _row("small-s1-zero2", "zero2", 2, 32, 3.051, seed=1), _row("wide", "single", 1, 64, 2.5)]
    table = results(rows)
    assert list(table["run_id"]) == ["small", "small-s1", "wide"]  # the seed is another run, the layout is not
    assert list(table["twins"]) == ["", "small-s1-zero2", ""]
    experiment = list(table["experiment"])
    assert experiment[0] == experiment[1] != experiment[2]


def test_task_scores_beside_a_run_are_a_column_per_task(tmp_path):
    import dataclasses
    import json

    rows = [dataclasses.replace(_row(name, "single", 1, d, 3.0), run_dir=tmp_path / name)
            for name, d in (("small", 32), ("wide", 64))]
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "eval.json").write_text(json.dumps({"tasks": {"tiny": {"step": 4, "metrics": {
        "acc": 0.75, "acc_stderr": 0.1}}}}))
    table = results(rows)
    assert table["task_tiny"].iloc[0] == 0.75 and table["task_tiny"].isna().iloc[1]
