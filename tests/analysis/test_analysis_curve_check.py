"""The curve law held to the seed noise (``python -m analysis.curve_check``) on a tiny synthetic sweep folder."""

import json

import numpy as np
import pytest

from analysis.curve_check import main
from analysis.curves import law_loss, schedule_lr
from lab.measure.laws import Curve, curve_theta

TRUTH = {"E": 0.5, "B": 2e5, "beta": 1.2, "A": 3e3, "alpha": 0.2, "C": 1e-3, "lambda": 0.995, "K": 0.3, "tau": 60.0}
BATCH = 512
NOISE = 0.003  # log-normal noise of every eval point


def _lr(n: float) -> float:
    return 1e-2 * (n / 1e4) ** -0.25


def _write_run(folder, n: float, steps: int, seed: int, scale: float = 1.0) -> None:
    """A finished cosine run folder whose eval curve follows TRUTH with noise ``NOISE`` (seeded), times ``scale``."""
    lr = schedule_lr("cosine", _lr(n), steps)
    points = np.arange(25, steps + 1, 25)
    points = points[points > round(0.05 * steps)]
    loss = law_loss(curve_theta(TRUTH), [Curve("probe", n, lr, points, np.zeros(len(points)), "cosine")])
    loss = scale * loss * np.exp(NOISE * np.random.default_rng(seed).standard_normal(len(points)))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"train": {
        "tokens": steps * BATCH, "batch_tokens": BATCH, "lr": _lr(n), "schedule": "cosine", "warmup": 0.05,
        "decay": 0.2, "min_lr_ratio": 0.1, "seed": seed}}))
    (folder / "summary.json").write_text(json.dumps({"status": "completed", "params": n, "total_steps": steps,
                                                     "flops": 6 * n * steps * BATCH}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": int(s), "eval_loss": float(v)}) + "\n"
                                                  for s, v in zip(points, loss)))


def _sweep(root, off: float = 1.0):
    """Budgets 1x, 2x and 4x (steps 1,000 x N / 1e4 at 1x), two seeds at the smallest, a size beyond the fitted ones
    at the largest, and one verify run; ``off`` scales one curve of the largest budget."""
    for i, scale in enumerate((1, 2, 4)):
        for n in ((1e4, 2e4, 4e4) if scale < 4 else (1e4, 2e4, 8e4)):
            steps = int(1000 * scale * 1e4 / n)
            seeds = (0, 1) if scale == 1 else (0,)
            for seed in seeds:
                _write_run(root / "runs" / f"C{scale}-{n:g}-s{seed}", n, steps, seed + 10 * i,
                           off if (scale, n) == (4, 2e4) else 1.0)
    _write_run(root / "verify" / "runs" / "verify-2e4", 2e4, 8000, 99)
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("curve-check") / "sweep")


def test_a_law_that_holds_is_met_beside_the_measured_seed_noise(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "check.json").read_text())
    # Two seeds with independent noise NOISE per point differ by about 1.13 NOISE on average.
    assert len(doc["seed_pairs"]) == 3 and doc["seed_noise"] == pytest.approx(1.13 * NOISE, rel=0.3)
    assert doc["bound"] == 0.01 and doc["met"] and doc["median_error"] < 0.01
    assert [r["role"] for r in doc["held_out"]] == ["largest budget"] * 3 + ["verify"]
    outside = [r["run_id"] for r in doc["held_out"] if not r["in_domain"]]
    assert outside == ["C4-80000-s0"]
    assert "warning [extrapolation]: 1 held-out run(s)" in printed and "C4-80000-s0" in printed
    assert "seed noise: median" in printed and printed.rstrip().splitlines()[-2].endswith(": met")
    assert (tmp_path / "out" / "check.png").read_bytes()[:4] == b"\x89PNG"


def test_a_curve_off_the_law_is_not_met_and_bad_input_is_refused(tmp_path, capsys):
    off = _sweep(tmp_path / "off", off=1.04)
    assert main([str(off)]) == 1
    printed = capsys.readouterr().out
    assert "C4-20000-s0" in printed and "(beyond its bound)" in printed and printed.rstrip().endswith("NOT met")
    assert main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    (off / "verify" / "runs" / "verify-2e4" / "summary.json").unlink()  # verify still running: checked without it
    assert main([str(off)]) == 1
    assert "verify-2e4" not in capsys.readouterr().out
