"""Command-line front ends for training and sampling (``launch/run.py``, ``launch/sample.py``): the run's arguments
and its launch; the run's lifecycle itself is ``lab.training.lifecycle``.

Exit codes of a run: 0 done (or stopped by ``train.stop_after``), 1 diverged or a checkpoint could not be
written (a full disk: the previous checkpoint is kept), 2 bad input (one
``error:`` line, before any work where the check allows), 130 / 143 interrupted by SIGINT /
SIGTERM (a checkpoint and ``summary.json`` with status ``interrupted`` are written first). Under
torchrun the first process of each machine prints a bad-input line; with ``--nproc-per-node N`` the
run starts its own ranks and exits with the first failed rank's code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from lab.runtime import checkpoint
from lab.runtime.config import ConfigError, Parser, RunConfig, build_parser, config_from_args, print_error
from lab.data import load_tokenizer
from lab.measure.device import size_threads, usable_cores
from lab.runtime.files import check_path, probe_writable, replacing
from lab.runtime.loopback import listen_on_loopback
from lab.runtime.processes import AGENT_PID, check_rank_environment, rank_dies_with_agent
from lab.runtime.extras import require
from lab.model import GPT
from lab.training import lifecycle
from lab.training.lifecycle import config_tree, preflight


def _error(msg: str) -> int:
    print_error(msg)
    return 2


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """``--nproc-per-node N``: check the run for N ranks here, then start them on this machine with torchrun's
    launcher (standalone). Bad input gives one ``error:`` line and exit 2 before any rank starts; afterwards
    the exit code is the first failed rank's (that rank printed why), or 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if args.nproc_per_node < 1:
        return _error(f"--nproc-per-node must be positive, got {args.nproc_per_node}")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return _error("--nproc-per-node starts the processes itself; under torchrun leave it out")
    try:
        preflight(config_from_args(args), _named_run_dir(args), args.resume, ranks=args.nproc_per_node)
    except ConfigError as e:
        return _error(str(e))
    # each rank's share of the cores (torchrun would give each 1 thread, with a banner saying so)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // args.nproc_per_node)))
    # the ranks say what failed or where they stopped; torch gives each of its modules' loggers its own level
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    torchrun = ["--standalone", f"--nproc-per-node={args.nproc_per_node}", "-m", "lab", "train"]
    listen_on_loopback()  # the launcher's stores answer this machine alone
    os.environ[AGENT_PID] = str(os.getpid())  # its ranks die with it; a torchrun this process starts later is not it
    try:
        run(get_args_parser().parse_args([*torchrun, *argv, "--nproc-per-node", "1"]))
    except SignalException as e:  # torchrun's launcher passed the signal on to the ranks, which stopped and said where
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        print_error(f"rank {rank} was killed by signal {-failure.exitcode} ({failure.signal_name()})")
        return 128 - failure.exitcode
    finally:
        del os.environ[AGENT_PID]
    return 0


def run_parser(prog: str = "launch/run.py") -> argparse.ArgumentParser:
    """The run's command line: every config option (``build_parser``) and ``--nproc-per-node``."""
    parser = build_parser(prog, "Train a GPT on prepared text and write a run directory.")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="start N processes on this machine (torchrun's launcher) after checking the run for N "
                             "ranks: bad input then fails once, before any starts (default: this process alone, or "
                             "the ranks torchrun started)")
    return parser


def run_main(argv: list[str] | None = None, prog: str = "launch/run.py") -> int:
    """Train one run; see the module docstring for the exit codes."""
    parser = run_parser(prog)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_rank_environment()
    except ConfigError as e:
        return _error(str(e))
    rank_dies_with_agent()
    args = parser.parse_args(argv)
    if args.nproc_per_node != 1:
        return launch_ranks(args, argv)
    size_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # before the CPU peak, which is per thread count
    try:
        cfg, run_dir = config_from_args(args), _named_run_dir(args)
        world, mode, estimate = preflight(cfg, run_dir, args.resume)
    except ConfigError as e:
        return _error(str(e))
    except KeyboardInterrupt:
        print("error: interrupted before training started", file=sys.stderr)
        return 130
    return lifecycle.run(cfg, world, run_dir, mode, estimate)


def _named_run_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.run_dir) if args.run_dir else None


# ---------------------------------------------------------------- sampling and export


def run_config(run_dir: Path) -> RunConfig:
    """The resolved config a run directory was trained with; ConfigError (one line) when there is none."""
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json)")
    return RunConfig.from_dict(config_tree(run_dir))


def checkpoint_weights(run_dir: Path, folder: str | None, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights from a checkpoint of any strategy and world size (the newest, or ``folder``)."""
    path = Path(folder) if folder else checkpoint.latest(run_dir)
    if path is None:
        raise ConfigError(f"no checkpoint in {run_dir / 'checkpoints'}")
    if not (path / checkpoint.META).is_file():
        raise ConfigError(f"{path} is not a checkpoint (no {checkpoint.META})")
    shapes = {name: p.shape for name, p in model.named_parameters()}
    return checkpoint.load_model(path, shapes)


def add_run_dir_arguments(p: argparse.ArgumentParser) -> None:
    """The run directory, as an argument or as --run-dir (the same for every command that reads a run)."""
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory written by python -m lab train")
    p.add_argument("--run-dir", dest="run_dir_option", metavar="RUN_DIR", help="the same, as an option")
    p.add_argument("--checkpoint", help="a checkpoints/step-N folder (default: the newest)")


def chosen_run_dir(args: argparse.Namespace) -> Path:
    """The run directory given as an argument or as --run-dir; ConfigError for neither or two different ones."""
    given = {a for a in (args.run_dir, args.run_dir_option) if a is not None}
    if len(given) != 1:
        raise ConfigError("give the run directory once, as an argument or as --run-dir" if given else
                          "which run? give its run directory (as an argument or as --run-dir)")
    return Path(given.pop())


def run_weights(run_dir: Path, cfg: RunConfig, folder: str | None) -> tuple[dict[str, torch.Tensor], int]:
    """A run's whole weights from its newest checkpoint (or ``folder``), and that checkpoint's step."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    weights = checkpoint_weights(run_dir, folder, model)
    return weights, checkpoint.read_meta(Path(folder) if folder else checkpoint.latest(run_dir))["step"]


def _check_pt_out(out: Path) -> None:
    """ConfigError (one line) unless ``out`` can be the export's one file (it replaces a file, never a folder)."""
    check_path(out, "--out")
    if out.is_dir() or out.is_symlink():
        raise ConfigError(f"--out {out} is a folder or a link; a pt export is one file (give its name)")


def export_main(argv: list[str] | None = None, prog: str = "launch/export.py") -> int:
    """Write one run's weights, from any checkpoint, as a single state-dict file (loadable with weights_only=True)
    or as a Hugging Face folder (``--format hf``: ``lab.commands.hf``)."""
    p = Parser(prog=prog, description="Export a run's weights as one plain state-dict file "
                                      "(torch.load(path, weights_only=True) reads it), or with --format hf as a "
                                      "Hugging Face folder (AutoModelForCausalLM and AutoTokenizer load it).")
    add_run_dir_arguments(p)
    p.add_argument("out_folder", nargs="?", metavar="OUT", help="where to write (the same as --out)")
    p.add_argument("--format", choices=("pt", "hf"), default="pt",
                   help="pt: one torch file; hf: config.json, model.safetensors and the tokenizer (the hf extra)")
    p.add_argument("--out", help="the file (pt) or folder (hf) to write (default: RUN_DIR/export/model-step-N.pt, "
                                 "or RUN_DIR/export/hf-step-N)")
    args = p.parse_intermixed_args(argv)  # RUN --format hf OUT
    try:
        run_dir = chosen_run_dir(args)
        if args.out and args.out_folder:
            raise ConfigError("give OUT or --out, not both")
        if args.format == "hf":
            from lab.commands import hf
            for module in ("transformers", "safetensors"):
                require(module, "export --format hf")
        cfg = run_config(run_dir)
        if args.format == "hf":
            hf.check_exportable(cfg.model)
        given = args.out or args.out_folder
        if given:  # before the weights are read
            hf.check_out(Path(given)) if args.format == "hf" else _check_pt_out(Path(given))
        weights, step = run_weights(run_dir, cfg, args.checkpoint)
        default = f"model-step-{step:06d}.pt" if args.format == "pt" else f"hf-step-{step:06d}"
        out = Path(args.out or args.out_folder or run_dir / "export" / default)
        probe_writable(out.parent, "--out")
        if args.format == "hf":
            hf.export_hf(cfg, weights, run_dir, out)
    except ConfigError as e:
        return _error(str(e))
    if args.format == "pt":
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with replacing(out) as tmp:
                torch.save({"model": weights, "config": cfg.to_dict(), "step": step}, tmp)
        except OSError as e:
            return _error(f"--out {out} could not be written ({e.strerror or e})")
    print(f"wrote {out}: {sum(w.numel() for w in weights.values()):,} parameters at step {step}")
    return 0


def sample_main(argv: list[str] | None = None, prog: str = "launch/sample.py") -> int:
    """Generate text from a run's newest (or a given) checkpoint."""
    p = Parser(prog=prog, description="Sample text from a trained run.")
    add_run_dir_arguments(p)
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--num-samples", type=int, default=1, help="how many samples to draw from the same prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens only; 0 for all")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed draws the same samples")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.num_samples <= 0 or args.temperature < 0 or args.top_k < 0:
        return _error("--tokens and --num-samples must be positive, --temperature and --top-k >= 0")
    if not args.prompt:
        return _error("--prompt must not be empty")
    try:
        run_dir = chosen_run_dir(args)
        cfg = run_config(run_dir)
        model = GPT(cfg.model)
        model.load_state_dict(checkpoint_weights(run_dir, args.checkpoint, model))
        tokenizer = load_tokenizer(run_dir / "tokenizer")
    except ConfigError as e:
        return _error(str(e))
    model.eval()
    prompt = torch.tensor([tokenizer.encode(args.prompt)] * args.num_samples, dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k or None,
                         generator=generator)
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(row))
    return 0
