"""A sweep under μP: [rules] mup_base_width and one tuned learning rate, passed to every planned run."""

from __future__ import annotations

import pytest

from lab.runtime.config import build_parser, config_from_args
from lab.model import validate, width_ratio
from sweeps import runs as planner
from sweeps import spec

MUP = """
[sweep]
name = "mup"
budgets = [1e13, 1e14]
sizes = [3e5, 1e6, 3e6]
[shapes]
aspect = 32
width_multiple = 64
head_dim = 64
[rules]
lr = 4e-3
mup_base_width = 64
batch_tokens = 16384
[base]
model = { block_size = 256 }
data = { vocab_size = 4096 }
train = { micro_batch = 8 }
"""


@pytest.mark.slow
def test_every_planned_run_is_mup_at_the_one_tuned_lr():
    runs = planner.plan(spec.parse(MUP, folder="/tmp/unused")).runs
    assert len({r.shape["d_model"] for r in runs}) >= 3  # several widths, one rate
    for run in runs:
        assert run.lr == 4e-3
        args = list(run.args)
        for option, value in (("--model.parametrization", "mup"), ("--model.mup_base_width", "64"),
                              ("--train.lr", "0.004")):
            assert args[args.index(option) + 1] == value
        cfg = config_from_args(build_parser("run", "").parse_args(args))
        validate(cfg.model)
        assert width_ratio(cfg.model) == run.shape["d_model"] / 64


def test_a_standard_sweep_plans_no_parametrization_option():
    standard = MUP.replace("mup_base_width = 64\n", "")
    assert all("--model.parametrization" not in r.args for r in planner.plan(spec.parse(standard, "s", "/tmp/u")).runs)


@pytest.mark.parametrize("edit, message", [
    (("lr = 4e-3", "lr = { value = 4e-3, exponent = -0.25 }"), "[rules] lr: with mup_base_width, give the one rate"),
    (("mup_base_width = 64", "mup_base_width = 0"), "[rules] mup_base_width must be an integer >= 1, got 0"),
    (("model = { block_size = 256 }", 'model = { block_size = 256, parametrization = "mup" }'),
     "[base.model] sets 'parametrization'; ask for μP with [rules] mup_base_width = W"),
    (("[base]", "[search]\nbudget = 1e13\nsizes = [3e5, 1e6]\nlr = [1e-3, 2e-3, 4e-3]\n[base]"),
     "[search] fits LR(N) per size; with [rules] mup_base_width give the rate tuned at the base width"),
])
def test_bad_mup_sweep_files_fail_with_one_line(edit, message):
    with pytest.raises(spec.SpecError) as info:
        spec.parse(MUP.replace(*edit), folder="/tmp/unused")
    assert message in str(info.value) and "\n" not in str(info.value)
