"""Cooldowns as end points: the option's checks, the plan of parents and branches, a branch's losses against a run
trained straight through, and a sweep that runs, resumes and exports them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab.training.lifecycle import resolve_vocab
from lab.data import load_tokenizer, prepare
from lab.parallel import World
from lab.runtime.config import build_parser, config_from_args
from lab.training import schedule
from lab.training.lifecycle import train
from sweeps import cli, cooldowns, spec
from sweeps.executors.attempt import Outcome
from sweeps.runs import PlannedRun
from sweeps.registry import Registry, Row

WSD = {"schedule": "wsd", "warmup": 0.1}
SMALL = [{"name": "small", "n_layer": 2, "d_model": 32, "n_head": 2}]
# 'small' (275,712 FLOPs per token) at 256 tokens a step: 12, 24 and 36 steps
BUDGETS = (8.47e8, 1.694e9, 2.541e9)


def planned(path: Path) -> list[PlannedRun]:
    return cli._planned(spec.load(path)).runs


def option(run: PlannedRun, name: str) -> str:
    return dict(zip(run.args[::2], run.args[1::2]))[name]


def config(run: PlannedRun):
    """The run's resolved config, as launch/run.py builds it from the planned options."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args(list(run.args)))
    data_dir = prepare(cfg.data, progress=False)
    resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
    return cfg, data_dir


@pytest.mark.parametrize("train, extra, message", [
    ({}, "cooldowns = { fraction = 0.2 }", "needs [base.train] schedule = \"wsd\""),
    (WSD, "cooldowns = { fraction = 1.2 }", "cooldowns.fraction must be below 1"),
    (WSD, "cooldowns = { fraction = 0.95 }", "leave room for the warmup"),
    (WSD, "cooldowns = { fraction = -0.2 }", "must be positive"),
    (WSD, "cooldowns = { fraction = 0.2, at = [0.5, 0.25] }", "cooldowns.at must be increasing fractions"),
    (WSD, "cooldowns = { fraction = 0.2, at = [0.5, 1.5] }", "cooldowns.at must be increasing fractions"),
    (WSD, "cooldowns = { fraction = 0.2, at = [0.5, 0.5] }", "cooldowns.at has duplicate values"),
    (WSD, "cooldowns = { fraction = 0.2, every = 3 }", "must be { fraction = F }"),
    (WSD, "cooldowns = 0.2", "must be { fraction = F }"),
    ({**WSD, "decay": 0.3}, "cooldowns = { fraction = 0.2 }", "differ; the cooldown is the WSD decay"),
])
def test_bad_cooldowns_are_one_line_and_exit_2_before_any_work(tmp_path, write_sweep, capsys, train, extra, message):
    path = write_sweep(tmp_path / "s.toml", shapes=SMALL, budgets=BUDGETS, train=train)
    path.write_text(path.read_text().replace('name = "t"', f'name = "t"\n{extra}', 1))
    folder = tmp_path / "sweep"
    assert cli.main(["run", str(path), "--folder", str(folder), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not folder.exists()


@pytest.fixture(scope="module")
def family(tmp_path_factory, write_sweep) -> tuple[Path, list[PlannedRun], list[PlannedRun]]:
    """A cooldown sweep of one size at three budgets: its plan, and the same sweep's plan without cooldowns."""
    folder = tmp_path_factory.mktemp("cooldowns")
    plain = write_sweep(folder / "plain.toml", shapes=SMALL, budgets=BUDGETS, train={**WSD, "decay": 0.25})
    path = folder / "cool.toml"
    path.write_text(plain.read_text().replace('name = "t"', 'name = "t"\ncooldowns = { fraction = 0.25 }', 1))
    return path, planned(path), planned(plain)


def test_the_plan_branches_each_end_point_from_one_stable_phase(family):
    _, runs, separate = family
    parent, *branches = runs
    assert parent.role == "parent" and parent.parent is None and [r.parent for r in branches] == [parent.name] * 3
    # every end point as a separate run would have it: N, D, C, budget, learning rate, batch
    assert [(r.name, r.params, r.tokens, r.flops, r.budget, r.lr, r.batch_tokens) for r in branches] == \
        [(r.name, r.params, r.tokens, r.flops, r.budget, r.lr, r.batch_tokens) for r in separate]
    steps = [r.tokens // r.batch_tokens for r in branches]
    assert steps == [12, 24, 36]
    assert [r.branch_step for r in branches] == [9, 18, 27]  # each decays over its last quarter
    assert parent.tokens == 27 * parent.batch_tokens and option(parent, "--train.checkpoint_steps") == "9,18,27"
    assert option(parent, "--train.decay") == "0.0"
    assert [r.flops_spent for r in branches] == [r.flops_per_token * 3 * s / 12 * r.batch_tokens
                                                 for r, s in zip(branches, steps)]
    spent = parent.flops_spent + sum(r.flops_spent for r in branches)
    ends = sum(r.flops for r in separate)
    assert spent == pytest.approx(ends * (27 + 3 + 6 + 9) / (12 + 24 + 36))
    assert cooldowns.savings(runs).startswith(f"cooldowns: 1 stable phase(s), 3 branch(es): the plan spends "
                                              f"{spent:.3g} FLOPs against {ends:.3g}")
    # the branches and their parent follow one schedule up to each branch point: the same rate at every step
    parent_cfg = config(parent)[0].train
    for run, total in zip(branches, steps):
        cfg = config(run)[0].train
        assert [schedule.learning_rate(s, total, cfg) for s in range(run.branch_step)] == \
            [schedule.learning_rate(s, 27, parent_cfg) for s in range(run.branch_step)]
        assert round(cfg.warmup * total) == round(0.1 * 12)  # the shortest end point's warmup, in steps
        assert schedule.learning_rate(total - 1, total, cfg) == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # decayed


def test_plan_command_shows_branches_and_the_flops_saved(family, capsys):
    path, _, _ = family
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "C8.47e8-small  " in out and "← C2.54e9-small-stable @ step 9" in out  # named after its longest end point
    assert "C2.54e9-small-stable: 27 stable steps → C8.47e8-small @ 9, C1.69e9-small @ 18, C2.54e9-small @ 27" in out
    assert "(37.5% saved; computed from the plan)" in out  # 1 - 45/72


def test_at_adds_end_points_at_fractions_of_each_sizes_longest(family, tmp_path):
    path, runs, _ = family
    more = tmp_path / "more.toml"
    more.write_text(path.read_text().replace("fraction = 0.25 }", "fraction = 0.25, at = [0.25, 0.5, 1.0] }"))
    parent, *branches = planned(more)
    assert [(r.name, r.tokens // r.batch_tokens, r.branch_step) for r in branches] == [
        ("C8.47e8-small", 12, 9), ("C1.69e9-small", 24, 18), ("C2.54e9-small", 36, 27),
        ("C2.54e9-small-at0.25", 9, 7), ("C2.54e9-small-at0.5", 18, 14)]  # 1.0 is the longest itself
    extra = branches[3]
    assert extra.budget == extra.flops == extra.flops_per_token * 9 * extra.batch_tokens
    assert option(parent, "--train.checkpoint_steps") == "7,9,14,18,27" and parent.tokens == runs[0].tokens
    # the shortest end point (9 steps) now sets the warmup every run of the family shares
    assert {round(config(r)[0].train.warmup * r.tokens / r.batch_tokens) for r in [parent, *branches]} == {1}


def _rows(runs: list[PlannedRun], folder: Path) -> dict[str, Row]:
    dirs = cooldowns.run_dirs(folder, runs)
    return {r.name: Row(r.name, r.config_hash, "done", dirs(r.name), r, 1, None, None, None) for r in runs}


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.long
@pytest.mark.slow  # trains about 90 steps in-process (20 s on a busy machine)
def test_a_branch_continues_its_parent_exactly_as_a_run_trained_straight_through(family, tmp_path):
    """Bitwise: the branch starts from the parent's weights, AdamW state and step, and its schedule goes on."""
    _, runs, _ = family
    parent, short, _, longest = runs
    rows = _rows(runs, tmp_path)
    world = World(0, 1, 0, torch.device("cpu"))
    cfg, data_dir = config(parent)
    assert train(cfg, data_dir, rows[parent.name].run_dir, world)["steps"] == 27
    kept = sorted(p.name for p in (rows[parent.name].run_dir / "checkpoints").iterdir())
    assert {"step-000009", "step-000018", "step-000027"} <= set(kept)  # pinned beside keep_checkpoints' newest
    for branch in (short, longest):
        row = rows[branch.name]
        assert cooldowns.seed(row, rows[parent.name]) is None
        cfg, _ = config(branch)
        summary = train(cfg, data_dir, row.run_dir, world, resume=True)
        assert summary["resumed_from_step"] == branch.branch_step and summary["status"] == "completed"
        assert summary["flops"] == branch.flops  # the end point's C, as a separate run
        straight = tmp_path / f"straight-{branch.name}"
        train(cfg, data_dir, straight, world)
        got, want = _losses(row.run_dir), _losses(straight)
        assert sorted(got) == sorted(want)  # the parent's steps up to the branch, then the branch's
        assert [got[s] for s in sorted(got) if s > branch.branch_step] == \
            [want[s] for s in sorted(want) if s > branch.branch_step]
        assert all(got[s] == want[s] for s in got)


def test_seeding_needs_the_parents_checkpoint_and_is_done_once(family, tmp_path):
    _, runs, _ = family
    parent, short = runs[0], runs[1]
    rows = _rows(runs, tmp_path)
    problem = cooldowns.seed(rows[short.name], rows[parent.name])
    assert problem.startswith(f"parent {parent.name} has no checkpoint at step 9")
    assert not rows[short.name].run_dir.exists()


class RecordingExecutor:
    """An executor that records what it is handed and fails every run (no process is started)."""

    name = "local"

    def __init__(self):
        self.handed: list[list[str]] = []

    def run(self, attempts, events) -> None:
        self.handed.append([a.run.name for a in attempts])
        for a in attempts:
            if events.start(a):
                events.started(a, "0")
                events.finished(a, Outcome("failed", error="error: failed on purpose"))


def test_a_branch_waits_for_its_parent(family, tmp_path):
    _, runs, _ = family
    registry = Registry.open(tmp_path, create=True)
    registry.sync(runs, cooldowns.run_dirs(tmp_path, runs))
    executor = RecordingExecutor()
    assert cooldowns.execute_branched(tmp_path, registry, runs, executor, progress=False) == 1
    assert executor.handed == [[runs[0].name]]  # the parent only: its branches wait
    assert [registry.get(r.name).status for r in runs] == ["failed", "planned", "planned", "planned"]
    assert not any(registry.get(r.name).run_dir.exists() for r in runs[1:])


SHAPES = SMALL + [{"name": "wide", "n_layer": 2, "d_model": 64, "n_head": 2}]


@pytest.mark.long
@pytest.mark.slow
def test_a_cooldown_sweep_runs_resumes_exports_and_fits(tmp_path, write_sweep, sweeps_cli, registry_rows, completions,
                                                        capsys):
    plain = write_sweep(tmp_path / "plain.toml", shapes=SHAPES, budgets=BUDGETS, train=WSD, local={"parallel": 2})
    path = tmp_path / "cool.toml"
    path.write_text(plain.read_text().replace('name = "t"', 'name = "t"\ncooldowns = { fraction = 0.25 }', 1))
    folder = tmp_path / "sweep"
    proc = sweeps_cli("run", path, "--folder", folder, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = registry_rows(folder)
    parents = sorted(n for n in rows if n.endswith("-stable"))
    assert len(rows) == 8 and len(parents) == 2
    for name, row in rows.items():
        plan = json.loads(row["plan"])
        assert row["status"] == "done" and row["attempts"] == 1 and completions(folder, name) == 1
        if name in parents:
            assert plan["role"] == "parent" and Path(row["run_dir"]) == folder / "parent" / "runs" / name
            continue
        assert plan["parent"] in parents and plan["branch_step"] > 0
        summary = json.loads(row["summary"])
        assert summary["resumed_from_step"] == plan["branch_step"]
        assert summary["flops"] == pytest.approx(plan["flops_per_token"] * plan["tokens"])
        metrics = (Path(row["run_dir"]) / "metrics.jsonl").read_text()
        assert '"step": 1,' in metrics  # the parent's steps before the branch are in the branch's curve
    assert cli.main(["status", str(folder)]) == 0
    status = capsys.readouterr().out
    assert all(f"  ← {json.loads(r['plan'])['parent']} @ step {json.loads(r['plan'])['branch_step']}" in status
               for n, r in rows.items() if n not in parents)
    # a second driver retrains nothing: finished parents and branches stay as they are
    assert cli.main(["run", str(path), "--folder", str(folder), "--no-progress"]) == 0  # in-process: starts nothing
    assert {n: r["attempts"] for n, r in registry_rows(folder).items()} == {n: 1 for n in rows}
    # the export: one row per end point, with its parent, its branch step and what it spent
    out = tmp_path / "runs.csv"
    assert cli.main(["export", str(folder), "--out", str(out)]) == 0
    table = pd.read_csv(out)
    assert sorted(table["run_id"]) == sorted(n for n in rows if n not in parents)
    for _, r in table.iterrows():
        plan = json.loads(rows[r["run_id"]]["plan"])
        assert r["parent"] == plan["parent"] and r["branch_step"] == plan["branch_step"]
        assert r["flops_spent"] == pytest.approx(r["flops"] * (1 - plan["branch_step"] * plan["batch_tokens"]
                                                                / plan["tokens"]))
    # the analysis reads the branches as runs, with N, D, C and loss of their end points, from either input
    from analysis.table import load_runs

    for source in (folder, out):
        loaded = load_runs(source).runs.set_index("run_id")
        assert sorted(Path(i).name for i in loaded.index) == sorted(table["run_id"])
        for _, r in table.iterrows():
            got = loaded.loc[r["run_id"] if source == out else f"runs/{r['run_id']}"]
            assert (got["params"], got["tokens"]) == (r["params"], r["tokens"])
            assert got["flops"] == pytest.approx(r["flops"]) and got["loss"] == pytest.approx(r["loss"])


@pytest.mark.parametrize("steps", ["0", "9,x", "9,13", "-1", "9;10"])
def test_checkpoint_steps_outside_the_run_are_refused_in_one_line(steps):
    from lab.runtime.config import ConfigError, RunConfig
    from lab.training.plan import plan_run

    cfg = RunConfig.from_dict({"model": {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 32},
                               "train": {"tokens": 3072, "batch_tokens": 256, "micro_batch": 4,
                                         "checkpoint_steps": steps}})
    with pytest.raises(ConfigError, match=r"^train.checkpoint_steps must be comma-separated steps in 1..12, got "):
        plan_run(cfg, 1)
    plan_run(RunConfig.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "checkpoint_steps": "3, 12"}}),
             1)


def test_an_end_point_too_short_to_branch_after_its_warmup_is_refused(tmp_path, write_sweep, capsys):
    path = write_sweep(tmp_path / "s.toml", shapes=SMALL, budgets=(7.06e7, BUDGETS[0]), train=WSD)  # 1 and 12 steps
    path.write_text(path.read_text().replace('name = "t"', 'name = "t"\ncooldowns = { fraction = 0.6 }', 1))
    assert cli.main(["plan", str(path)]) == 2
    assert "error: cooldowns: C7.06e7-small (1 steps) would branch at step 0, before the end of its warmup" in \
        capsys.readouterr().err
