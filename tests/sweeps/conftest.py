"""Helpers for the sweep tests: tiny sweep files on the tiny corpus, the command line as a subprocess."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from lab.runtime.config import DataConfig

REPO = Path(__file__).resolve().parents[2]
# Two tiny shapes (2 layers, width 32 or 64, context 32): a run of 8 steps takes a few seconds on CPU.
SHAPES = [{"name": "small", "n_layer": 2, "d_model": 32, "n_head": 2},
          {"name": "wide", "n_layer": 2, "d_model": 64, "n_head": 2}]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # numbers, and strings (JSON escapes are valid TOML)


def sweep_text(data, name: str = "t", budgets=(6e8, 1.2e9), shapes=SHAPES, extra: str = "",
               train: dict | None = None, local: dict | None = None) -> str:
    """A sweep file over explicit tiny shapes, on the tiny corpus (``data``: a DataConfig).

    Runs use one thread each: tiny models gain nothing from more, and spinning threads on a busy
    machine slow them down many times over. They checkpoint only at the end (and when a signal stops them)
    unless ``train`` sets checkpoint_every: about ten saves per run cost more than the steps."""
    train = {"micro_batch": 4, "eval_tokens": 512, "log_every": 1, "checkpoint_every": 0, **(train or {})}
    lines = ["[sweep]", f"name = {toml_value(name)}", f"budgets = {toml_value(list(budgets))}", "",
             "[shapes]", 'family = "list"']
    for shape in shapes:
        lines += ["[[shapes.list]]"] + [f"{k} = {toml_value(v)}" for k, v in shape.items()]
    lines += ["", "[rules]", "lr = 1e-2", "batch_tokens = 256", "",
              "[base]", f"model = {toml_value({'block_size': 32})}",
              "data = " + toml_value({"corpus": str(data.corpus), "cache_dir": str(data.cache_dir),
                                      "vocab_size": data.vocab_size}),
              f"train = {toml_value(train)}", "", "[estimate]", "flops_per_s = 1e9", "overhead_s = 4", "",
              "[local]"] + [f"{k} = {toml_value(v)}" for k, v in {"threads": 1, **(local or {})}.items()] + ["", extra]
    return "\n".join(lines) + "\n"


def _sweeps_cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m sweeps ARGS`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "sweeps", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **kw)


def _registry_rows(folder: Path) -> dict[str, dict]:
    """The registry read with plain SQL, so the tests do not depend on the Registry class."""
    conn = sqlite3.connect(folder / "sweep.db")
    conn.row_factory = sqlite3.Row
    try:
        return {r["name"]: dict(r) for r in conn.execute("SELECT * FROM runs")}
    except sqlite3.OperationalError as e:  # a driver that has created the file but not yet its table
        if "no such table" not in str(e):
            raise
        return {}
    finally:
        conn.close()


def _completions(folder: Path, name: str) -> int:
    """How many attempts of a run finished it ('done (completed)' lines across its attempt logs)."""
    logs = sorted((folder / "logs" / name).glob("attempt-*.log"))
    return sum(log.read_text(errors="replace").count("done (completed)") for log in logs)


@pytest.fixture(scope="session")
def write_sweep(tiny_corpus, tiny_cache_dir, tiny_prepared):
    """(path, **sweep_text options) -> path: a tiny sweep file on the prepared tiny corpus."""
    data = DataConfig(corpus=str(tiny_corpus), cache_dir=str(tiny_cache_dir), vocab_size=512)

    def write(path: Path, **options) -> Path:
        path.write_text(sweep_text(data, **options))
        return path
    return write


@pytest.fixture
def sweeps_cli():
    """``python -m sweeps ARGS`` in a subprocess from the repository root."""
    return _sweeps_cli


@pytest.fixture
def registry_rows():
    """folder -> {name: row} read from sweep.db with plain SQL."""
    return _registry_rows


@pytest.fixture
def completions():
    """(folder, name) -> how many attempts finished the run."""
    return _completions
