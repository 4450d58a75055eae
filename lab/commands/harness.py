"""``python -m lab eval RUN --tasks ...``: EleutherAI's lm-evaluation-harness on a run (the eval extra).

The run's checkpoint is exported on the fly as a Hugging Face folder (``lab.commands.hf``) and scored by the
harness's ``hf`` model, exactly as ``lm_eval --model hf --model_args pretrained=FOLDER`` scores an exported run.
The scores go to ``RUN_DIR/eval.json`` beside ``summary.json`` (tasks scored earlier are kept), where ``sweeps
export`` and ``analysis fit`` read them (``lab.runtime.scores``): a column ``task_NAME`` per task, its first metric.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from lab.commands.cli import _error, run_config, run_weights
from lab.runtime.config import ConfigError, Parser, did_you_mean
from lab.runtime.extras import require
from lab.runtime.files import save_json
from lab.runtime.scores import SCORES

def _metrics(result: dict) -> dict[str, float]:
    """The harness's ``{"acc,none": 0.5, "acc_stderr,none": ...}`` as ``{"acc": 0.5, "acc_stderr": ...}``,
    primary metrics first."""
    values = {key.split(",")[0]: v for key, v in result.items() if isinstance(v, (int, float)) and "," in key}
    return dict(sorted(values.items(), key=lambda kv: kv[0].endswith("_stderr")))


def main(argv: list[str] | None = None, prog: str = "python -m lab eval") -> int:
    p = Parser(prog=prog, description="Score a run with EleutherAI's lm-evaluation-harness (exported on the fly as "
                                      "a Hugging Face model); the scores go to RUN_DIR/eval.json.")
    p.add_argument("run_dir", help="a run directory written by launch/run.py")
    p.add_argument("--tasks", required=True, help="comma-separated harness task names")
    p.add_argument("--include-path", help="a folder of the harness's task YAML files (your own tasks)")
    p.add_argument("--checkpoint", help="a checkpoints/step-N folder (default: the newest)")
    p.add_argument("--limit", type=float, help="documents per task (a fraction when below 1; default: all)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        lm_eval = require("lm_eval", "eval")
        for module in ("transformers", "safetensors"):
            require(module, "eval")
        from lab.commands import hf

        cfg = run_config(run_dir)
        hf.check_exportable(cfg.model)
        if args.include_path and not Path(args.include_path).is_dir():
            raise ConfigError(f"--include-path {args.include_path} is not a folder")
        if not tasks:
            raise ConfigError("--tasks is empty")
        weights, step = run_weights(run_dir, cfg, args.checkpoint)
        from lm_eval.tasks import TaskManager

        # the harness's own few thousand task files take long to index: only when a task is not in --include-path
        manager = TaskManager(include_path=args.include_path, include_defaults=False) if args.include_path else None
        if manager is None or any(task not in manager.all_tasks for task in tasks):
            manager = TaskManager(include_path=args.include_path)
        for task in tasks:
            if task not in manager.all_tasks:
                raise ConfigError(f"--tasks: unknown task '{task}'{did_you_mean(task, manager.all_tasks)}")
    except ConfigError as e:
        return _error(str(e))
    with tempfile.TemporaryDirectory(prefix="lab-eval-") as tmp:
        folder = Path(tmp) / "hf"
        hf.export_hf(cfg, weights, run_dir, folder)
        out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32"},
                                      tasks=tasks, task_manager=manager, device="cpu", batch_size=args.batch_size,
                                      limit=args.limit, num_fewshot=args.num_fewshot, log_samples=False)
    scores = {task: {"step": step, "metrics": _metrics(out["results"][task])} for task in tasks}
    previous = json.loads((run_dir / SCORES).read_text()) if (run_dir / SCORES).is_file() else {}
    save_json(run_dir / SCORES, {"tasks": {**previous.get("tasks", {}), **scores}})
    for task, entry in scores.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in entry["metrics"].items()))
    print(f"wrote {run_dir / SCORES} (checkpoint of step {step})")
    return 0
