"""IsoFLOP vertex error: a parabola through the whole profile against one fitted in a window.

Run: ``.venv/bin/python benchmarks/analysis/bench_isoflop_window.py [--seeds 200]``.

Profiles are drawn from a known law at C = 1e20 with sizes from N_opt*offset/spread to
N_opt*offset*spread, so offset != 1 makes them lopsided. For each profile shape, law and noise
level it prints the error of the vertex in log10 N against the true optimum: the mean (bias) and
root mean square over seeds, for the whole-profile parabola (the method before issue 12) and for
the windowed vertex of ``analysis.isoflop``; plus how often the window rejects a noisy profile
(vertex outside the window), which the bootstrap then counts as a failed resample.
"""

from __future__ import annotations

import argparse

import numpy as np

from analysis.isoflop import budget_minima
from analysis.synthetic import CHINCHILLA, law_loss, law_optimum

EPOCH = {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}
SHAPES = ((1.0, 8.0, 9), (5.0, 10.0, 12), (0.2, 10.0, 12), (4.0, 16.0, 14), (3.0, 10.0, 12), (1.0, 30.0, 15))


def _whole_profile_vertex(x: np.ndarray, loss: np.ndarray) -> float:
    c2, c1, _ = np.polyfit(x, loss, 2)
    return -c1 / (2 * c2) if c2 > 0 else np.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    flops = np.array([1e20])
    print("law        sizes (x N_opt)    n   noise | whole profile: bias  rms | window: bias  rms  rejected")
    for name, law in (("Chinchilla", CHINCHILLA), ("Epoch AI", EPOCH)):
        truth = np.log10(law_optimum(flops, law)[0][0])
        for offset, spread, sizes in SHAPES:
            n = law_optimum(flops, law)[0][0] * np.geomspace(offset / spread, offset * spread, sizes)
            clean = law_loss(n, flops[0] / (6 * n), law)
            x = np.log10(n)
            for noise in (0.0, 0.002, 0.005):
                seeds = args.seeds if noise else 1
                losses = clean * np.exp(noise * rng.standard_normal((seeds, sizes)))
                whole = np.array([_whole_profile_vertex(x, row) for row in losses]) - truth
                minima = budget_minima(np.tile(n, seeds), losses.ravel(), np.repeat(np.arange(seeds), sizes),
                                       np.full(seeds, flops[0]), np.ones((1, seeds * sizes)))
                window = minima.vertex_log_n[0] / np.log(10) - truth
                ok = minima.vertex_ok[0] & minima.sided[0]
                print(f"{name:<10} {offset / spread:5.3g} - {offset * spread:<5.3g} {sizes:4d} {noise:6.1%} | "
                      f"{np.nanmean(whole):+.4f} {np.sqrt(np.nanmean(whole ** 2)):.4f} | "
                      f"{np.mean(window[ok]):+.4f} {np.sqrt(np.mean(window[ok] ** 2)):.4f} {1 - ok.mean():6.1%}")


if __name__ == "__main__":
    main()
