"""``python -m lab eval RUN --tasks ...``: EleutherAI's lm-evaluation-harness on a run (the eval extra).

The run's checkpoint is exported on the fly as a Hugging Face folder (``lab.commands.hf``) and scored by the
harness's ``hf`` model, exactly as ``lm_eval --model hf --model_args pretrained=FOLDER`` scores an exported run.
The scores go to ``RUN_DIR/eval.json`` beside ``summary.json`` (tasks scored earlier are kept), where ``sweeps
export`` and ``analysis fit`` read them (``lab.runtime.scores``): a column ``task_NAME`` per task, its first metric.

Offline (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` set, or the Hub's endpoint not answering within
``HUB_PROBE_S``), every task's dataset must be local: a copy in the datasets cache, or files a task YAML of
``--include-path`` reads. One that is not is named in one line (exit 2) before any export, instead of the harness
retrying the Hub and ending in a traceback.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lab.commands.cli import _error, run_config, run_weights
from lab.runtime.config import ConfigError, Parser, did_you_mean
from lab.runtime.extras import require
from lab.runtime.files import UnreadableFile, read_json, save_json
from lab.runtime.scores import SCORES

HUB_PROBE_S = 3.0  # how long a connection to the Hugging Face Hub may take before it counts as unreachable
OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # read by huggingface_hub and datasets at import
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' readers of local files


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is out of reach: offline mode is set, or no TCP connection to its endpoint
    (``HF_ENDPOINT``, by default huggingface.co) opens within ``HUB_PROBE_S`` seconds, name lookup included."""
    if any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE_SWITCHES):
        return True
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    answered: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                     timeout=HUB_PROBE_S).close()
            answered.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)  # a name lookup ignores the socket's timeout
    probe.start()
    probe.join(HUB_PROBE_S)
    return not answered


def read_task_yaml(path: Path) -> dict[str, Any]:
    """A harness task file as a dict, its ``include`` files merged under it and its ``!function`` tags left None."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader) or {}
    includes = config.pop("include", [])
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes]:
        merged.update(read_task_yaml(path.parent / include))
    return merged | config


def task_dataset(task: str, include_path: str | None, harness_tasks: Path) -> dict[str, Any] | None:
    """The ``dataset_path``, ``dataset_name`` and ``dataset_kwargs`` of the YAML file in ``include_path`` or the
    harness's own task folder that defines ``task``, found by its ``task:`` line (the harness's index of every
    task takes about 25 s); None when no file does (a group, or an unknown name: the harness's index judges)."""
    defines = re.compile(rf"^task:\s*['\"]?{re.escape(task)}['\"]?\s*$", re.MULTILINE)
    for folder in [*([Path(include_path)] if include_path else []), harness_tasks]:
        for path in sorted(folder.rglob("*.yaml")):
            if defines.search(path.read_text(encoding="utf-8", errors="replace")):
                config = read_task_yaml(path)
                return {"path": config.get("dataset_path"), "name": config.get("dataset_name"),
                        **(config.get("dataset_kwargs") or {})}
    return None


def check_local_datasets(tasks: list[str], include_path: str | None, harness_tasks: Path) -> None:
    """ConfigError naming the first task whose dataset is neither in the datasets cache nor in local files (run
    with the offline switches set, so nothing is fetched)."""
    import datasets

    for task in tasks:
        if (found := task_dataset(task, include_path, harness_tasks)) is None or found["path"] is None:
            continue
        try:
            datasets.load_dataset_builder(**found)
        except OSError as e:  # ConnectionError offline, FileNotFoundError for missing files
            if found["path"] in LOCAL_BUILDERS:
                raise ConfigError(f"--tasks {task}: its {found['path']} files {found.get('data_files')} cannot be "
                                  f"read ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
            name = found["path"] + (f" ({found['name']})" if found["name"] else "")
            raise ConfigError(f"--tasks {task}: its dataset {name} is not in the datasets cache and the Hugging Face "
                              f"Hub cannot be reached; fetch it once where the Hub is reachable (the cache is "
                              f"HF_DATASETS_CACHE), or give --include-path a task YAML whose dataset_path reads a "
                              f"local copy (dataset_path: json, dataset_kwargs: data_files)") from None


def _metrics(result: dict) -> dict[str, float]:
    """The harness's ``{"acc,none": 0.5, "acc_stderr,none": ...}`` as ``{"acc": 0.5, "acc_stderr": ...}``,
    primary metrics first."""
    values = {key.split(",")[0]: v for key, v in result.items() if isinstance(v, (int, float)) and "," in key}
    return dict(sorted(values.items(), key=lambda kv: kv[0].endswith("_stderr")))


def previous_scores(path: Path) -> dict[str, Any]:
    """The tasks a run's eval.json already scored (none without one), read bounded and never through a link;
    ConfigError (one line) when it is there but not the lab's, before any work."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        tasks = read_json(path).get("tasks")
    except (OSError, UnreadableFile, AttributeError) as e:
        raise ConfigError(f"{path} cannot be read ({e}): move it aside to score the run again") from None
    if not isinstance(tasks, dict):
        raise ConfigError(f"{path} holds no scores of tasks: move it aside to score the run again")
    return tasks


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
    offline = hub_offline()
    if offline:  # before huggingface_hub or datasets is imported: they read the switches once
        os.environ.update(dict.fromkeys(OFFLINE_SWITCHES, "1"))
    try:
        lm_eval = require("lm_eval", "eval")
        from lab.commands import hf

        cfg = run_config(run_dir)
        previous = previous_scores(run_dir / SCORES)
        hf.check_exportable(cfg.model)
        if args.include_path and not Path(args.include_path).is_dir():
            raise ConfigError(f"--include-path {args.include_path} is not a folder")
        if not tasks:
            raise ConfigError("--tasks is empty")
        if offline:
            check_local_datasets(tasks, args.include_path, Path(lm_eval.__file__).parent / "tasks")
        for module in ("transformers", "safetensors"):
            require(module, "eval")
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
    save_json(run_dir / SCORES, {"tasks": {**previous, **scores}})
    for task, entry in scores.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in entry["metrics"].items()))
    print(f"wrote {run_dir / SCORES} (checkpoint of step {step})")
    return 0
