"""The hyperparameter search (``[search]``): its file table, its runs, its fitted LR(N) and batch(C) laws, and
verify's pure parts (the shapes it trains and its verdict)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sweeps import runs as planner
from sweeps import search, spec, verify

SWEEP = """
[sweep]
name = "s"
budgets = [1e11, 2e11, 4e11]
centre = { prior = "tokens_per_param", tokens_per_param = 80 }
[search]
budget = 2e11
sizes = [8e3, 2.5e4, 8e4]
lr = [2e-3, 4e-3, 8e-3, 1.6e-2]
batch_tokens = [512, 1024, 2048, 4096]
batch_budgets = [1e11, 4e11]
[shapes]
aspect = 64
width_multiple = 8
head_dim = 8
max_layers = 1
[rules]
lr = 3e-3
batch_tokens = 512
[base]
model = { block_size = 128 }
data = { tokenizer = "bytes" }
train = { micro_batch = 4 }
"""


def parse(text: str = SWEEP) -> spec.Sweep:
    return spec.parse(text, folder="/tmp/unused")


@pytest.mark.parametrize("change, message", [
    (("budget = 2e11\n", ""), "[search] needs one of 'budget' (every size at one budget) and 'tokens_per_param'"),
    (("budget = 2e11\n", "budget = 2e11\ntokens_per_param = 40\n"), "[search] needs one of 'budget'"),
    (("budget = 2e11\nsizes", "tokens_per_param = 40\nsizes"), None),
    (("lr = [2e-3, 4e-3, 8e-3, 1.6e-2]", "lr = [2e-3, 4e-3]"), "[search] lr needs at least 3 values"),
    (("sizes = [8e3, 2.5e4, 8e4]", "sizes = [8e3]"), "[search] sizes needs at least 2 sizes"),
    (("batch_tokens = [512, 1024, 2048, 4096]\n", ""), "[search] batch_budgets needs batch_tokens"),
    (("budget = 2e11\n", "budget = 2e11\nsteps = 3\n"), "[search]: unknown key 'steps'"),
])
def test_bad_search_tables_are_refused_in_one_line(change, message):
    text = SWEEP.replace(*change)
    if message is None:  # a batch grid at each size's own budget: batch_budgets must say where
        text, message = text.replace("batch_budgets = [1e11, 4e11]\n", ""), "batch_tokens with tokens_per_param needs"
    with pytest.raises(spec.SpecError) as e:
        parse(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_search_needs_the_family():
    text = SWEEP.replace('centre = { prior = "tokens_per_param", tokens_per_param = 80 }\n', "").replace(
        "aspect = 64\nwidth_multiple = 8\nhead_dim = 8\nmax_layers = 1\n",
        'family = "list"\nlist = [{ name = "a", n_layer = 1, d_model = 8, n_head = 1 }]\n')
    with pytest.raises(spec.SpecError, match="needs the 'aspect' shape family"):
        parse(text)


@pytest.mark.slow
def test_the_search_plans_every_rate_per_size_and_every_batch_per_budget_at_its_prior():
    sweep = parse()
    lr_runs, refused = search.lr_runs(sweep)
    assert refused == []
    assert len(lr_runs) == 3 * 4 and {r.role for r in lr_runs} == {"search"}
    assert sorted({r.lr for r in lr_runs}) == [2e-3, 4e-3, 8e-3, 1.6e-2]
    assert {r.budget for r in lr_runs} == {2e11} and {r.batch_tokens for r in lr_runs} == {512}  # [rules] batch
    rule = spec.PowerRule(5e-3, -0.3, 3e4)
    batch_runs, refused = search.batch_runs(sweep, rule)
    assert refused == [] and len(batch_runs) == 2 * 4
    for budget in (1e11, 4e11):
        runs = [r for r in batch_runs if r.budget == budget]
        prior = search.batch_target(sweep, budget)
        assert {r.batch_tokens for r in runs} == {512, 1024, 2048, 4096}
        assert len({r.params for r in runs}) == 1 and runs[0].params == pytest.approx(prior, rel=0.5)
        assert runs[0].lr == pytest.approx(rule.at(runs[0].params), rel=1e-3)  # the LR law, not [rules]
    # a search run computing what a sweep run computes is still its own run
    hashes = {r.config_hash for r in planner.plan(sweep).runs}
    assert not hashes & {r.config_hash for r in lr_runs + batch_runs}


def test_with_tokens_per_param_each_size_searches_at_its_own_budget():
    sweep = parse(SWEEP.replace("budget = 2e11\n", "tokens_per_param = 40\n").replace(
        "batch_tokens = [512, 1024, 2048, 4096]\nbatch_budgets = [1e11, 4e11]\n", ""))
    runs, refused = search.lr_runs(sweep)
    assert refused == [] and len(runs) == 3 * 4
    for n in {r.params for r in runs}:
        grid = [r for r in runs if r.params == n]
        assert len({r.budget for r in grid}) == 1 and sorted(r.lr for r in grid) == [2e-3, 4e-3, 8e-3, 1.6e-2]
        assert grid[0].tokens == pytest.approx(40 * n, rel=0.01)  # D = 40 N, to whole batches
        assert grid[0].budget == pytest.approx(grid[0].flops, rel=0.01) and grid[0].name.startswith(
            f"search-C{planner.format_flops(grid[0].budget)}-")


def test_batches_that_round_to_one_run_are_refused():
    sweep = parse(SWEEP.replace("batch_tokens = [512, 1024, 2048, 4096]", "batch_tokens = [256, 512, 1024]"))
    refused = search.refusals(sweep)
    assert len(refused) == 2 and all("is the same run as" in line for line in refused)


def test_best_of_a_grid_is_the_parabola_vertex_or_the_edge():
    values = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
    optimum = 5e-3
    losses = [2 + 0.1 * math.log(v / optimum) ** 2 for v in values]
    best, interior = search.best_of(values, losses)
    assert interior and best == pytest.approx(optimum, rel=1e-9)
    best, interior = search.best_of(values, sorted(losses, reverse=True))  # falling to the right edge
    assert not interior and best == values[-1]
    losses[3] = math.inf  # a diverged run next to the best: the best is not located between finite neighbours
    assert search.best_of(values, losses)[1] is False


@pytest.mark.slow
def test_fitted_laws_recover_known_ones():
    """LR grids at 3 sizes whose loss has its minimum at 6e-3 (N / 2e4)^-0.4: LR(N) is recovered."""
    sweep = parse()
    runs, _ = search.lr_runs(sweep)
    true = spec.PowerRule(6e-3, -0.4, 2e4)
    pairs = [(r, 2.0 + 0.05 * math.log(r.lr / true.at(r.params)) ** 2) for r in runs]
    law, warnings = search.fit_lr(pairs)
    assert warnings == []
    assert law.rule.exponent == pytest.approx(-0.4, abs=1e-6)
    for n in (1e4, 5e4):
        assert law.rule.at(n) == pytest.approx(true.at(n), rel=1e-6)
    batch_runs, _ = search.batch_runs(sweep, law.rule)
    true_b = spec.PowerRule(1400, 0.5, 2e11)
    pairs = [(r, 2.0 + 0.05 * math.log(r.batch_tokens / true_b.at(r.budget)) ** 2) for r in batch_runs]
    batch, warnings = search.fit_batch(pairs)
    assert batch.rule.exponent == pytest.approx(0.5, abs=1e-6)
    assert batch.rule.at(3e11) == pytest.approx(true_b.at(3e11), rel=1e-6)
    result = search.SearchResult(law, batch, warnings)
    tuned = result.tuned
    planned = planner.plan(sweep, tuned).runs
    for r in planned:  # the sweep's runs take the laws, batches in whole micro-steps
        assert r.lr == pytest.approx(law.rule.at(r.params), rel=1e-3)
        assert r.batch_tokens == 512 * max(1, round(batch.rule.at(r.budget) / 512))


def test_a_grid_whose_best_is_at_its_edge_is_warned_about():
    runs, _ = search.lr_runs(parse())
    pairs = [(r, 3.0 - r.lr) for r in runs]  # the higher the better: every best at the top edge
    law, warnings = search.fit_lr(pairs)
    assert len(warnings) == 3 and all("edge" in w and "widen the grid" in w for w in warnings)


# ---------------------------------------------------------------- verify's pure parts


def test_verify_trains_the_shape_nearest_n_opt_and_one_size_step_either_side():
    sweep = parse()
    step = verify.size_step(sweep)
    assert step == pytest.approx(10 ** (1 / 6))  # ±0.5 decade in 7 sizes
    runs, refused = verify.plan_runs(sweep, 1.6e12, 6e4, None)
    assert refused == [] and len(runs) == 3 and {r.role for r in runs} == {"verify"}
    params = sorted(r.params for r in runs)
    assert params[0] < 6e4 * 1.2 and params[2] > 6e4 / 1.2 and params[0] < params[1] < params[2]
    assert all(r.name.startswith("verify-C1.6e12-") for r in runs)


def _theta(E: float, A: float, B: float, alpha: float, beta: float) -> np.ndarray:
    return np.array([math.log(A), math.log(B), math.log(E), alpha, beta])


def test_the_verdict_compares_achieved_with_predicted():
    from analysis.parametric import predict_loss

    sweep = parse()
    runs, _ = verify.plan_runs(sweep, 1.6e12, 6e4, None)
    theta = _theta(1.0, 50.0, 400.0, 0.4, 0.35)
    exact = [(r, float(predict_loss(theta, np.array([r.params]), np.array([r.tokens]))[0])) for r in runs]
    middle = sorted(r.params for r, _ in exact)[1]
    pred = verify.Prediction(1.6e12, "isoflop", middle, [middle / 1.5, middle * 1.5], 1.5, [1.4, 1.6])
    thetas = np.stack([theta * (1 + 0.01 * k) for k in range(-5, 6)])
    exact.sort(key=lambda rl: rl[0].params)
    # the middle run lowest, 0.2 % above its prediction; its neighbours 0.5 nats above theirs
    lows = [(r, loss * 1.002 if i == 1 else loss + 0.5) for i, (r, loss) in enumerate(exact)]
    v = verify.judge(pred, lows, theta, thetas, 0.95)
    assert v.n_opt_located and v.n_opt_inside and v.best == lows[1][0].name
    assert v.loss_within and v.verified
    assert all(r.predicted_loss_ci[0] <= r.predicted_loss <= r.predicted_loss_ci[1] for r in v.runs)
    assert v.loss_error == pytest.approx(0.002, abs=1e-9)
    off = [(r, loss * 1.05) for r, loss in lows]  # every loss 5 % higher
    v = verify.judge(pred, off, theta, thetas, 0.95)
    assert v.n_opt_inside and not v.loss_within and not v.verified
    assert v.loss_error == pytest.approx(1.002 * 1.05 - 1, abs=1e-9)
    edge = sorted(exact, key=lambda rl: -rl[0].params)  # falling towards the largest: N_opt not located
    edge = [(r, 2.0 + i * 0.1) for i, (r, _) in enumerate(edge)]
    v = verify.judge(pred, edge, theta, None, 0.95)
    assert not v.n_opt_located and not v.n_opt_inside and not v.verified
    text = "\n".join(verify.describe(v))
    assert "NOT verified" in text and "not located" in text


@pytest.mark.slow
def test_the_family_sets_the_mlp_width_from_ffn_ratio():
    sweep = parse(SWEEP.replace("max_layers = 1\n", "max_layers = 1\nffn_ratio = 2.6667\n")
                  .replace("model = { block_size = 128 }", 'model = { arch = "modern", block_size = 128 }'))
    for run in planner.plan(sweep).runs:
        assert run.shape["d_ff"] == round(2.6667 * run.shape["d_model"])
        assert f"--model.d_ff {run.shape['d_ff']}" in " ".join(run.args)
    assert all("d_ff" not in r.shape for r in planner.plan(parse()).runs)  # unset: the architecture's default


def test_verify_adds_a_size_step_while_the_lowest_run_is_at_an_edge():
    sweep = parse()
    runs, _ = verify.plan_runs(sweep, 1.6e12, 6e4, None)
    runs.sort(key=lambda r: r.params)
    assert verify.extension(sweep, 1.6e12, [(r, loss) for r, loss in zip(runs, (2.0, 1.9, 2.1))], None) == []
    falling = [(r, loss) for r, loss in zip(runs, (1.9, 2.0, 2.1))]  # lowest at the smallest: one step smaller
    (smaller,) = verify.extension(sweep, 1.6e12, falling, None)
    assert smaller.params < runs[0].params and smaller.role == "verify" and smaller.budget == 1.6e12
    (larger,) = verify.extension(sweep, 1.6e12, [(r, loss) for r, loss in zip(runs, (2.1, 2.0, 1.9))], None)
    assert larger.params > runs[-1].params
    v = verify.judge(verify.Prediction(1.6e12, "isoflop", runs[0].params, [1, 1e9], None, None),
                     falling + [(smaller, 2.0)], _theta(1.0, 50.0, 400.0, 0.4, 0.35), None, 0.95)
    assert v.n_opt_located and v.best == runs[0].name  # the extra run brackets the minimum
