"""The loss-curve law with the learning-rate schedule (analysis.curves, ``python -m analysis curves``)."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.cli import main
from analysis.curves import fit_curves, identification, law_loss, load_fit, relative_errors, schedule_lr
from lab.measure.laws import Curve, areas, curve_theta

TRUTH = {"E": 0.5, "B": 2e5, "beta": 1.2, "A": 3e3, "alpha": 0.2, "C": 1e-3, "lambda": 0.995, "K": 0.3, "tau": 60.0}
SIZES = ((1e4, 2000), (3e4, 1500), (1e5, 1000))  # (N, steps)


def _lr(n: float) -> float:
    return 1e-2 * (n / 1e4) ** -0.25  # a tuned rate falling with size, as the sweep's search finds


def _curve(n: float, kind: str, steps: int, noise: float = 0.0, seed: int = 0, every: int = 25) -> Curve:
    lr = schedule_lr(kind, _lr(n), steps)
    points = np.arange(every, steps + 1, every)
    points = points[points > round(0.05 * steps)]
    probe = Curve(f"{kind}-{n:g}", n, lr, points, np.zeros(len(points)), kind)
    loss = law_loss(curve_theta(TRUTH), [probe])
    loss = loss * np.exp(noise * np.random.default_rng(seed).standard_normal(len(points)))
    return Curve(probe.run_id, n, lr, points, loss, kind)


def test_areas_are_the_summed_rate_and_the_annealed_drop():
    lr = schedule_lr("wsd", 1e-2, 100, warmup=0.1, decay=0.3, min_lr_ratio=0.1)
    s1, s2 = areas(lr, 0.0)
    assert np.allclose(s1, np.cumsum(lr))
    assert np.allclose(s2, np.maximum.accumulate(lr) - lr)  # with lambda = 0, the drop below the peak so far
    assert np.all(s2[:10] == 0)  # the warm-up's rises are no annealing
    _, slow = areas(lr, 0.99)
    assert 0 < slow[-1] < s2[-1] * 30 and np.all(np.diff(slow) >= 0)  # a drop takes effect over time


def test_jacobian_matches_finite_differences():
    from lab.measure.laws import CurvePoints

    design = CurvePoints([_curve(n, kind, steps) for n, steps in SIZES[:2] for kind in ("cosine", "wsd")])
    theta = curve_theta(TRUTH)
    _, jac = design.loss_jac(theta)
    for i in range(len(theta)):
        step = np.zeros(len(theta))
        step[i] = 1e-6
        numeric = (design.loss_jac(theta + step, False)[0] - design.loss_jac(theta - step, False)[0]) / 2e-6
        assert np.allclose(jac[:, i], numeric, rtol=1e-5, atol=1e-9), i


def _recorded_curves() -> tuple[list[Curve], np.ndarray]:
    """The default sweep's eval-loss curves (tests/analysis/data/README.md) and their budgets."""
    table = pd.read_csv(Path(__file__).parent / "data" / "tiny_isoflop_curves.csv")
    curves, flops = [], []
    for run_id, run in table.groupby("run_id", sort=True):
        first = run.iloc[0]
        lr = schedule_lr(first.schedule, float(first.lr), int(first.total_steps))
        curves.append(Curve(run_id, float(first.params), lr, run.step.to_numpy(int), run.eval_loss.to_numpy(float),
                            first.schedule))
        flops.append(float(first.flops))
    return curves, np.array(flops)


@pytest.mark.slow  # a fit of several seconds: in `make test`, not the edit loop
def test_the_default_sweeps_curves_predict_its_largest_budget():
    """Fitted on the sweep's 55 runs up to 1e12 FLOPs, the law predicts each of the 7 curves at 2e12 within 2.5 %
    mean relative error, five of them within 1.1 % (measured 0.42-2.35 %; without the early transient 1.1-2.2 %; the
    first extension, E + B/N^beta + A S1^-alpha - C S2 with absolute areas, 1.9-9.9 %; benchmarks/curves/README.md)."""
    curves, flops = _recorded_curves()
    fit = fit_curves([c for c, f in zip(curves, flops) if f < 1.5e12], n_bootstrap=0)
    assert fit.converged and fit.n_runs == 55 and fit.rmse_log_loss < 0.016
    held = [c for c, f in zip(curves, flops) if f > 1.5e12]
    errors = sorted(float(np.mean(np.abs(relative_errors(fit, c)))) for c in held)
    assert len(held) == 7 and errors[-1] < 0.025 and errors[4] < 0.011, errors


def test_every_size_starts_on_one_curve_with_its_own_tuned_rate():
    """Sizes whose tuned peak rate falls as N^-0.9 (as the sweep's search finds) follow one curve early and part
    for their own floors: fitted on three sizes, the law predicts a larger size's longer curve within 0.3 %."""
    truth = curve_theta(TRUTH)
    made = []
    for n, steps in ((1e4, 3000), (3e4, 2000), (1e5, 1500), (1e4, 1000), (3e4, 800)):
        lr = schedule_lr("cosine", 1e-2 * (n / 1e4) ** -0.9, steps)
        points = np.arange(steps // 16, steps + 1, steps // 16)
        probe = Curve(f"{n:g}-{steps}", n, lr, points, np.zeros(len(points)), "cosine")
        made.append(Curve(probe.run_id, n, lr, points, law_loss(truth, [probe]), "cosine"))
    fit = fit_curves(made, n_bootstrap=0)
    lr = schedule_lr("cosine", 1e-2 * 30 ** -0.9, 4000)
    target = Curve("3e5", 3e5, lr, np.arange(250, 4001, 250), np.zeros(16), "cosine")
    target = Curve("3e5", 3e5, lr, target.steps, law_loss(truth, [target]), "cosine")
    assert np.mean(np.abs(relative_errors(fit, target))) < 0.003


def test_a_curves_law_of_another_form_is_refused(tmp_path):
    """A curves.json of the first extension (same seven numbers, another law) is refused by analysis and by the
    training loop's watcher, not read as this law."""
    from lab.training.expect import LawError, watcher

    fit = fit_curves([_curve(n, "cosine", steps) for n, steps in SIZES], n_bootstrap=0)
    assert load_fit({"fit": fit.to_dict()}).params == pytest.approx(fit.params)
    old = {"fit": {**fit.to_dict(), "law": "L(N, s) = E + B/N^beta + A*S1(s)^(-alpha) - C*S2(s)"}}
    with pytest.raises(Exception, match="another form"):
        load_fit(old)
    (tmp_path / "curves.json").write_text(json.dumps(old))
    with pytest.raises(LawError, match="another form"):
        watcher(tmp_path / "curves.json", 1e4, schedule_lr("cosine", 1e-2, 100), 512)


@pytest.mark.slow  # a fit of several seconds: in `make test`, not the edit loop
def test_fit_recovers_the_law_and_predicts_another_schedule():
    curves = [_curve(n, kind, steps) for n, steps in SIZES for kind in ("cosine", "constant", "wsd")]
    fit = fit_curves(curves, n_bootstrap=0)
    assert fit.converged and fit.rmse_log_loss < 1e-6
    for name, value in TRUTH.items():
        assert fit.params[name] == pytest.approx(value, rel=1e-3), name
    # fitted on cosine runs only, the law predicts a WSD run of another size (and the reverse) within 0.5 %
    for train, test in (("cosine", "wsd"), ("wsd", "cosine")):
        noisy = [_curve(n, train, steps, noise=0.003, seed=i) for i, (n, steps) in enumerate(SIZES)]
        noisy += [_curve(n, "constant", steps, noise=0.003, seed=9 + i) for i, (n, steps) in enumerate(SIZES)]
        fit = fit_curves(noisy, n_bootstrap=0)
        err = relative_errors(fit, _curve(5e4, test, 1200))
        assert np.mean(np.abs(err)) < 0.005, (train, test, np.mean(np.abs(err)))


@pytest.mark.slow
def test_bootstrap_intervals_cover_the_truth_and_bad_input_is_refused():
    # an eval every 10 steps: with the transient's two parameters, every 25 left beta's interval just short of
    # the truth for one resampling seed in two
    curves = [_curve(n, kind, steps, noise=0.003, seed=i, every=10) for i, (n, steps) in enumerate(SIZES)
              for kind in ("cosine", "wsd")]
    fit = fit_curves(curves, n_bootstrap=30, seed=1)
    ci = fit.ci()
    for name in ("E", "beta", "alpha"):
        assert ci[name][0] <= TRUTH[name] <= ci[name][1], (name, ci[name])
    steps, loss, lo, hi = fit.predict(5e4, schedule_lr("wsd", _lr(5e4), 800))
    assert len(steps) == 800 and np.all(lo[40:] <= loss[40:]) and np.all(loss[40:] <= hi[40:])
    with pytest.raises(Exception, match="at least 3 runs"):
        fit_curves(curves[:2])
    few = Curve("few", 1e4, curves[0].lr, curves[0].steps[:2], curves[0].loss[:2])
    with pytest.raises(Exception, match="train.eval_every"):
        fit_curves(curves + [few])


def _write_run(folder, curve: Curve, kind: str, steps: int, lr: float, evals: bool = True) -> None:
    folder.mkdir(parents=True)
    batch = 512
    (folder / "config.json").write_text(json.dumps({"train": {
        "tokens": steps * batch, "batch_tokens": batch, "lr": lr, "schedule": kind, "warmup": 0.05, "decay": 0.2,
        "min_lr_ratio": 0.1}}))
    (folder / "summary.json").write_text(json.dumps({"status": "completed", "params": curve.params, "steps": steps,
                                                     "total_steps": steps, "flops": 6 * curve.params * steps * batch}))
    lines = [json.dumps({"step": int(s), "tokens": int(s) * batch, "loss": float(v) * 1.01}) for s, v in
             zip(curve.steps, curve.loss)]
    if evals:
        lines += [json.dumps({"step": int(s), "tokens": int(s) * batch, "eval_loss": float(v)}) for s, v in
                  zip(curve.steps, curve.loss)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.long
@pytest.mark.slow
def test_cli_fits_a_sweep_holds_out_wsd_and_predicts(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for i, (n, steps) in enumerate(SIZES):
        for kind in ("cosine", "constant", "wsd"):
            _write_run(sweep / f"{kind}-{i}", _curve(n, kind, steps, noise=0.002, seed=i), kind, steps, _lr(n))
    out = tmp_path / "out"
    assert main(["curves", str(sweep), "--out", str(out), "--hold-out", "schedule == 'wsd'", "--bootstrap", "10",
                 "--predict", "5e4,wsd,1200,6.7e-3"]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "curves.json").read_text())
    assert doc["fit"]["n_runs"] == 6 and len(doc["holdout"]) == 3
    assert all(h["mean_rel_error"] < 0.005 for h in doc["holdout"]), doc["holdout"]
    assert "held out wsd-0" in printed and "predicted N=5e+04, wsd, 1200 steps" in printed
    predicted = (out / doc["predictions"][0]["csv"]).read_text().splitlines()
    assert predicted[0] == "step,lr,loss,lo,hi" and len(predicted) == 1201
    assert (out / "curves_fit.png").read_bytes()[:4] == b"\x89PNG"
    # the training loss instead of the held-out one
    assert main(["curves", str(sweep), "--out", str(tmp_path / "train"), "--loss", "train", "--bootstrap", "0"]) == 0
    train = json.loads((tmp_path / "train" / "curves.json").read_text())
    assert train["loss"] == "train" and train["fit"]["params"]["E"] != doc["fit"]["params"]["E"]
    # bad input: one line, exit 2, nothing written
    sparse = tmp_path / "sparse"
    _write_run(sparse / "one", _curve(1e4, "cosine", 2000, every=2000), "cosine", 2000, 1e-2)
    for argv, message in [
        ([str(sweep), "--hold-out", "params > 0"], "must leave some runs"),
        ([str(sweep), "--hold-out", "nonsense >"], "--hold-out"),
        ([str(sweep), "--predict", "1e5,triangle,100,1e-3"], "train.schedule must be one of"),
        ([str(sweep), "--predict", "1e5,wsd"], "N,SCHEDULE,STEPS,LR"),
        ([str(tmp_path / "none")], "no such folder"),
        ([str(sweep), str(sparse)], "train.eval_every"),
    ]:
        assert main(["curves", *argv, "--out", str(tmp_path / "bad")]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, (argv, err)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_watch_flags_a_run_that_goes_off_track_once_and_an_on_track_run_never(tmp_path, capsys):
    """A curves fit of law-made runs; a new run on the law stays quiet, the same run whose loss jumps 5 % at step 600
    (what a learning rate x10 there does) warns once, three evals after the jump, and is drawn."""
    from analysis.watch import watch_run
    from lab.training.expect import OFF_TRACK_EVALS

    sweep = tmp_path / "sweep"
    for i, (n, steps) in enumerate(SIZES):
        for kind in ("cosine", "wsd"):
            _write_run(sweep / f"{kind}-{i}", _curve(n, kind, steps, noise=0.002, seed=i), kind, steps, _lr(n))
    assert main(["curves", str(sweep), "--out", str(tmp_path / "law"), "--bootstrap", "20"]) == 0
    law = tmp_path / "law" / "curves.json"
    on_track = _curve(5e4, "wsd", 1200, noise=0.002, seed=7, every=50)
    _write_run(tmp_path / "on", on_track, "wsd", 1200, _lr(5e4))
    jumped = on_track.loss * np.where(on_track.steps >= 600, 1.05, 1.0)
    _write_run(tmp_path / "off", Curve("off", 5e4, on_track.lr, on_track.steps, jumped), "wsd", 1200, _lr(5e4))
    capsys.readouterr()
    quiet, lines = watch_run(tmp_path / "on", law)
    # noise of 0.2 % puts an eval outside the 95 % band now and then; a warning needs OFF_TRACK_EVALS in a row
    assert quiet.warned_at is None and sum(not e.inside for e in quiet.history) <= 1, lines
    assert lines[-1] == "on track: no warning"
    # the watcher (lab.training.expect, the training loop's) evaluates the law as analysis.curves predicts it
    fit = load_fit(json.loads(law.read_text()))
    for step in (100, 600, 1200):
        _, loss, lo, hi = fit.predict(5e4, on_track.lr, np.array([step]))
        assert quiet.law(step) == pytest.approx((loss[0], lo[0], hi[0]), rel=1e-9)
    assert main(["watch", str(tmp_path / "off"), "--law", str(law)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("OFF TRACK") == 1 and f"went off track at step {600 + 50 * (OFF_TRACK_EVALS - 1)}" in printed
    assert "expected" in printed and "OUTSIDE" in printed
    assert (tmp_path / "off" / "watch.png").read_bytes()[:4] == b"\x89PNG"
    # a fit.json law is refused cleanly when it is neither kind
    (tmp_path / "other.json").write_text("{}")
    assert main(["watch", str(tmp_path / "off"), "--law", str(tmp_path / "other.json")]) == 2
    assert "neither a curves.json" in capsys.readouterr().err


def test_too_few_points_name_the_option_of_the_loss_that_was_asked_for(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for i, (n, steps) in enumerate(SIZES):
        _write_run(sweep / f"run-{i}", _curve(n, "cosine", steps, every=steps // 2), "cosine", steps, _lr(n))
    for loss, option in (("train", "log the training loss more often (train.log_every)"),
                         ("eval", "log the held-out loss more often (train.eval_every")):
        assert main(["curves", str(sweep), "--out", str(tmp_path / "out"), "--loss", loss]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and f"fewer than 3 {loss}-loss points" in err and option in err, err
    assert not (tmp_path / "out").exists()


def test_a_law_the_runs_cannot_pin_down_is_flagged_and_one_they_can_is_not(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for i, (n, steps) in enumerate(SIZES):  # three runs of three points: as many as the law's parameters
        _write_run(sweep / f"run-{i}", _curve(n, "cosine", steps, noise=0.003, seed=i, every=steps // 3), "cosine",
                   steps, _lr(n))
    assert main(["curves", str(sweep), "--out", str(tmp_path / "out"), "--bootstrap", "10"]) == 0
    warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning [unidentified]")]
    assert len(warning) == 1 and "9 points for 9 parameters" in warning[0], warning
    fit = json.loads((tmp_path / "out" / "curves.json").read_text())["fit"]
    assert fit["identified"] is False and fit["problems"]

    curves = [_curve(n, "cosine", steps) for n, steps in SIZES]
    fit = fit_curves(curves, n_bootstrap=0)
    assert identification(fit, curves) == []
    # resamples that disagree by a factor e on the floor leave every final loss loose
    loose = dataclasses.replace(fit, thetas=np.stack([fit.theta, fit.theta + np.eye(len(fit.theta))[0]]))
    problems = identification(loose, curves)
    assert len(problems) == 1 and "final loss" in problems[0] and "(> 10%)" in problems[0], problems
    assert identification(dataclasses.replace(fit, converged=False), curves) == [
        "the least-squares fit did not converge"]
    two_sizes = curves[:2] + [dataclasses.replace(curves[2], params=curves[1].params)]
    assert identification(fit, two_sizes) == ["2 sizes (the power of N needs 3)"]
