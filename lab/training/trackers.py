"""Trackers: rank 0's metrics, config and summary also go to TensorBoard and Weights & Biases (``--log.trackers``).

Every step record's numbers (loss, lr, grad norm, tokens/s, MFU, comm and step time, peak memory) and every eval
loss (with ``--train.expect`` the law's expected loss and the deviation from it) go to each tracker at their step; the
resolved config at the start, the summary's numbers at the end. A record's warning (a run gone off track) becomes a
text event under ``warnings`` in TensorBoard and a W&B alert (with the run summary's ``warning``).
TensorBoard writes event files into ``RUN_DIR/tensorboard`` (a sweep folder then opens as one TensorBoard);
W&B keeps its files in ``RUN_DIR/wandb`` and its run id in ``RUN_DIR/wandb-id``, so a resumed run continues the
same W&B run. A tracker is a convenience, never a reason to lose a run: a missing package or a tracker that
raises costs one warning line on stderr and that tracker alone is dropped.
"""

from __future__ import annotations

import secrets
import sys
import tomllib
from pathlib import Path
from typing import Any

from lab.runtime.config import ConfigError, LogConfig, did_you_mean
from lab.runtime.extras import extra_of, installed

RECORD_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "comm_time_s", "compute_time_s", "step_time_s",
               "mem_peak_bytes", "skipped_steps", "tokens", "eval_loss", "expected_loss", "deviation",
               "moe_load_max_over_mean", "moe_dropped_tokens", "moe_dropped_fraction", "moe_router_entropy",
               "ep_a2a_bytes", "ep_a2a_bytes_theory")
EVAL_KEYS = ("eval_loss", "expected_loss", "deviation")  # under eval/, the others under train/


def names(cfg: LogConfig) -> list[str]:
    return [n.strip() for n in cfg.trackers.split(",") if n.strip()]


def validate(cfg: LogConfig) -> None:
    for name in names(cfg):
        if name not in BACKENDS:
            raise ConfigError(f"log.trackers: unknown tracker '{name}'{did_you_mean(name, BACKENDS)} "
                              f"(known: {', '.join(BACKENDS)})")


def tag(key: str) -> str:
    return f"{'eval' if key in EVAL_KEYS else 'train'}/{key}"


def numbers(record: dict[str, Any], keys: tuple[str, ...] | None = None) -> dict[str, float]:
    """The finite-or-not numeric fields of ``record`` (all, or those of ``keys``), booleans left out."""
    return {k: float(v) for k, v in record.items() if (keys is None or k in keys)
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    module = "tensorboard"

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict, resumed_at: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops what its earlier segment logged after the checkpoint it resumes from
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=resumed_at + 1 if resumed_at else None)
        self.writer.add_text("config", "\n".join(f"    {s}.{k} = {v!r}" for s, t in config.items()
                                                 for k, v in t.items()), 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(tag(key), value, step)

    def alert(self, step: int, text: str) -> None:
        self.writer.add_text("warnings", text, step)

    def summary(self, values: dict[str, float]) -> None:
        self.writer.add_text("summary", "\n".join(f"    {k} = {v:.6g}" for k, v in values.items()), 0)

    def close(self) -> None:
        self.writer.close()


def sweep_name(run_dir: Path) -> str | None:
    """The sweep's name when ``run_dir`` is a sweep's run (``SWEEP/runs/NAME`` beside ``SWEEP/sweep.toml``)."""
    spec = run_dir.parent.parent / "sweep.toml"
    if run_dir.parent.name != "runs" or not spec.is_file():
        return None
    try:
        return tomllib.loads(spec.read_text()).get("sweep", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return None


class WandB:
    module = "wandb"

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict, resumed_at: int):
        import wandb

        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, id=run_id, resume="allow",
                              group=cfg.wandb_group or sweep_name(run_dir), name=cfg.wandb_name or run_dir.name,
                              dir=str(run_dir), config=config, reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({tag(k): v for k, v in values.items()}, step=step)

    def alert(self, step: int, text: str) -> None:
        self.run.alert(title=f"{self.run.name}: {text.split(':', 1)[0]}"[:63], text=f"step {step}: {text}",
                       level="WARN")
        self.run.summary.update({"warning": text, "warning_step": step})

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


BACKENDS: dict[str, type] = {"tensorboard": TensorBoard, "wandb": WandB}


class Trackers:
    """The run's trackers (rank 0), from step ``resumed_at`` + 1 on; each call reaches every one still working."""

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict, resumed_at: int):
        self.live: dict[str, Any] = {}
        for name in names(cfg):
            backend = BACKENDS[name]
            if not installed(backend.module):
                self._warn(name, f"{backend.module} is not installed (pip install -e '.[{extra_of(backend.module)}]')")
                continue
            self._call(name, lambda: self.live.__setitem__(name, backend(cfg, run_dir, config, resumed_at)))

    @staticmethod
    def _warn(name: str, why: str) -> None:
        print(f"warning: tracker {name} is off for this run: {why}", file=sys.stderr, flush=True)

    def _call(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # a tracker never stops the run
            self.live.pop(name, None)
            self._warn(name, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self.live.items()):
            self._call(name, lambda: getattr(tracker, method)(*args))

    def record(self, rec: dict[str, Any]) -> None:
        values = numbers(rec, RECORD_KEYS)
        if values:
            self._each("log", rec["step"], values)
        if isinstance(rec.get("warning"), str):
            self._each("alert", rec["step"], rec["warning"])

    def summary(self, summary: dict[str, Any]) -> None:
        self._each("summary", numbers(summary))

    def close(self) -> None:
        self._each("close")
        self.live.clear()
