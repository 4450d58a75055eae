"""The batch sweep's section of a sweep file (``[critical_batch]``): what it plans, what it refuses, and the plan."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sweeps import cli, critical_batch, spec

REPO = Path(__file__).resolve().parents[2]
BATCH = """
[sweep]
name = "batch"
evals = 8
[critical_batch]
sizes = [1.9e4]
batch_tokens = [256, 1024, 4096]
lr = { value = 0.01, exponent = 0.5, reference = 256 }
lr_factors = [0.5, 1.0]
tokens = 2e5
steps = 40
targets = [2.0, 2.2]
warmup_steps = 10
[critical_batch.held_out]
sizes = [5.2e4]
targets = [1.9]
[shapes]
family = "aspect"
aspect = 64
width_multiple = 8
head_dim = 8
max_layers = 1
[base]
model = { arch = "modern", block_size = 128 }
data = { tokenizer = "bytes" }
train = { schedule = "constant" }
"""


def parse(text: str) -> spec.Sweep:
    return spec.parse(text, folder="/tmp/unused")


def test_each_size_batch_and_rate_is_one_run_long_enough_on_the_frontier_shape():
    sweep = parse(BATCH)
    runs, refused = critical_batch.runs(sweep)
    assert not refused and len(runs) == 2 * 3 * 2  # (grid + held-out) x batches x rates
    cb = sweep.critical_batch
    assert cb.targets == (2.2, 2.0)  # sorted high to low
    for run in runs:
        args = dict(zip(run.args[::2], run.args[1::2]))
        batch = run.batch_tokens
        assert batch in cb.batch_tokens and run.tokens % batch == 0
        assert abs(run.tokens - (cb.tokens + cb.steps * batch)) <= batch / 2  # E_min + S_min B, whole batches
        assert args["--train.micro_batch"] == str(batch // 128)  # one micro-step per batch
        steps = run.tokens // batch
        assert round(float(args["--train.warmup"]) * steps) == cb.warmup_steps  # the warmup in steps, every run
        assert args["--train.eval_every"] == str(max(1, steps // 8))
        assert min(abs(run.lr / cb.lr.at(batch) - f) for f in (0.5, 1.0)) < 1e-3  # no size rule: lr(B) x factor
    held = [r for r in runs if r.name.startswith("heldout-")]
    assert len(held) == 6 and len({r.params for r in held}) == 1 and held[0].params > runs[0].params
    doc = critical_batch.manifest(sweep)
    assert doc["targets"] == [2.2, 2.0] and doc["held_out_targets"] == [1.9]
    assert sorted(doc["runs"].values()).count("held-out") == 6


def test_held_out_sizes_may_try_rates_of_their_own():
    sweep = parse(BATCH.replace("targets = [1.9]", "targets = [1.9]\nlr_factors = [1.0, 0.25]"))
    held = [r for r in critical_batch.runs(sweep)[0] if r.name.startswith("heldout-")]
    assert sweep.critical_batch.held_out.lr_factors == (0.25, 1.0) and len(held) == 3 * 2
    assert {round(r.lr / sweep.critical_batch.lr.at(r.batch_tokens), 3) for r in held} == {0.25, 1.0}


def test_the_rate_scales_with_the_size_rule():
    sweep = parse(BATCH.replace("lr_factors = [0.5, 1.0]", "lr_factors = [1.0]\nlr_size = { value = 1, exponent = -1, "
                                                                                "reference = 1e4 }"))
    runs, _ = critical_batch.runs(sweep)
    for run in runs:
        expected = sweep.critical_batch.lr.at(run.batch_tokens) * 1e4 / run.params
        assert run.lr == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("edit, message", [
    (("batch_tokens = [256, 1024, 4096]", "batch_tokens = [256, 1024, 2048]"),
     "[critical_batch] batch_tokens span 8x (256 to 2048); the frontier needs at least 16x"),
    (("batch_tokens = [256, 1024, 4096]", "batch_tokens = [256, 4096]"),
     "[critical_batch] batch_tokens needs at least 3 batches"),
    (("warmup_steps = 10", "warmup_steps = 10\nbatch = 3"), "[critical_batch]: unknown key 'batch'"),
    (("sizes = [5.2e4]", "sizes = [5.2e4]\nsteps_max = 3"), "[critical_batch] held_out: unknown key 'steps_max'"),
    (('train = { schedule = "constant" }', 'train = { schedule = "cosine" }'),
     '[critical_batch] needs [base.train] schedule = "constant"'),
    (('train = { schedule = "constant" }', 'train = { schedule = "constant", warmup = 0.1 }'),
     "[base.train] sets 'warmup'"),
    (('train = { schedule = "constant" }', 'train = { schedule = "constant", micro_batch = 4 }'),
     "[base.train] sets 'micro_batch'"),
    (("lr = { value = 0.01, exponent = 0.5, reference = 256 }\n", ""), "[critical_batch] needs 'lr'"),
    (("targets = [2.0, 2.2]\n", ""), "[critical_batch] needs 'targets'"),
    (("[critical_batch]", "[critical_batch]\nlr_size = { value = -1 }"), "lr_size"),
    (('name = "batch"', 'name = "batch"\nbudgets = [1e12]'), "[sweep] needs 'sizes' (target N) or 'centre'"),
])
def test_a_bad_batch_section_fails_with_one_line(edit, message):
    assert edit[0] in BATCH
    with pytest.raises(spec.SpecError) as info:
        parse(BATCH.replace(*edit))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_file_without_budgets_needs_a_batch_section():
    text = BATCH[:BATCH.index("[critical_batch]")] + BATCH[BATCH.index("[shapes]"):]
    with pytest.raises(spec.SpecError, match=r"\[sweep\] needs 'budgets'"):
        parse(text)


def test_a_held_out_size_on_a_grid_shape_is_refused():
    runs, refused = critical_batch.runs(parse(BATCH.replace("sizes = [5.2e4]", "sizes = [1.9e4]")))
    assert len(refused) == 1 and "a shape of the grid" in refused[0] and len(runs) == 6


def test_plan_states_the_batch_sweeps_runs_and_time(tmp_path, capsys):
    path = tmp_path / "batch.toml"
    path.write_text(BATCH)
    assert cli.main(["plan", str(path), "--folder", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^12 runs, .* estimated .* one after another$", out, re.M)
    assert "critical batch: grid: 1 size(s)" in out and "(16x)" in out and "targets 2.2, 2" in out
    assert not (tmp_path / "out").exists()  # plan writes nothing


def test_the_default_batch_sweep_plans_its_time_within_forty_minutes_at_two_at_once(capsys):
    assert cli.main(["plan", str(REPO / "sweeps" / "tiny_batch.toml"), "--folder", "/tmp/unused-tiny-batch"]) == 0
    out = capsys.readouterr().out
    minutes = float(re.search(r"about ([\d.]+)min with 2 at once", out).group(1))
    assert minutes <= 40
    sweep = spec.load(REPO / "sweeps" / "tiny_batch.toml")
    batches = sweep.critical_batch.batch_tokens
    assert batches[-1] / batches[0] >= 16 and len(sweep.critical_batch.targets) >= 3
    assert json.dumps(critical_batch.manifest(sweep))  # the manifest is JSON
