"""The one entry point, ``python -m lab COMMAND [options]`` (lab/__main__.py runs it); ``python -m lab COMMAND
--help`` for each command.

The ``launch/*.py`` scripts run the same functions; under torchrun pass either one
(``torchrun --nproc_per_node=2 -m lab train ...`` or ``torchrun --nproc_per_node=2 launch/run.py ...``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lab.runtime.config import Parser, did_you_mean, print_error

# name: (module, function, what it does); a command's module is imported only when it runs
COMMANDS = {
    "prepare": ("lab.data", "prepare_main", "tokenize a corpus into shards (a run does it on first use)"),
    "train": ("lab.commands.cli", "run_main", "train one run and write its run directory (under torchrun: one rank)"),
    "sample": ("lab.commands.cli", "sample_main", "sample text from a run's checkpoint"),
    "export": ("lab.commands.cli", "export_main", "export a run's weights as one state-dict file, or a Hugging Face "
               "folder"),
    "plot": ("lab.commands.plot", "main", "a run's curves (loss, eval loss, lr, grad norm, tokens/s), or several "
             "overlaid"),
    "import-hf": ("lab.commands.hf", "import_main", "a Hugging Face GPT-2 or Llama folder as a run directory to "
                  "fine-tune"),
    "eval": ("lab.commands.harness", "main", "score a run with lm-evaluation-harness; scores to RUN_DIR/eval.json"),
    "plan": ("lab.commands.resources", "main", "training time and memory on paper"),
    "bench": ("lab.commands.bench", "main", "throughput and MFU, or strategies side by side"),
    "bench-gpu": ("lab.commands.bench_gpu", "main", "what only a CUDA GPU shows: bf16, compile, NCCL, allocator "
                  "peaks, MFU"),
    "equivalence": ("lab.commands.equivalence", "main", "check strategies reproduce single's losses and weights"),
    "matrix": ("lab.commands.matrix", "main", "every strategy × tp × pp × ep layout on a few ranks against single"),
    "mup-check": ("lab.commands.mup", "main", "μP's coordinate check: activation scales across widths, as a table "
                  "and figure"),
    "peak": ("lab.measure.device", "peak_main", "this CPU's matmul peak (the MFU denominator): show, or --remeasure"),
    "options": ("lab.commands.options", "main", "every option of a run, its type, default and meaning "
                "(docs/options.md)"),
}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lab", description="The scaling lab's commands; python -m lab COMMAND --help for each.",
               epilog="commands:\n" + "\n".join(f"  {name:<12} {what}" for name, (_, _, what) in COMMANDS.items()))
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("command", metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's options (see python -m lab COMMAND --help)")
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        p.print_help()
        return 2
    args = p.parse_args(argv)
    if args.command not in COMMANDS:
        print_error(f"unknown command '{args.command}'{did_you_mean(args.command, COMMANDS)} "
                    f"(see python -m lab --help)")
        return 2
    module, function, _ = COMMANDS[args.command]
    return getattr(importlib.import_module(module), function)(args.args, prog=f"python -m lab {args.command}")
