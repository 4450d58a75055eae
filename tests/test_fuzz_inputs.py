"""A seeded fuzz of the files a user hands the lab (issue 59): the sweep file, the run config, the CSV and JSONL tables
of runs and a Hugging Face config.json, each mutated from a valid one (bytes flipped, cut or repeated; values
swapped for hostile ones: control characters, huge or non-finite numbers, wrong types, deep nesting). Every input
must end with no error or with the command's one-line refusal (ConfigError, InputError, exit 2; a sweep plan's
refusal is a line per run it cannot plan), never another exception, a hang, or a file written into the folder it was
read from. The functions are called in-process, each
input under an alarm.

The short tier (``make test``) tries a few hundred inputs; the ``long`` tier tries ``LAB_FUZZ_INPUTS`` (default
2,500) per kind, over 10,000 in all (its count and time are in docs/bad-inputs.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from analysis.synthetic import isoflop_runs
from analysis.table import InputError, load_runs
from lab.commands import hf
from lab.commands.cli import run_parser
from lab.runtime.config import ConfigError, config_from_args
from lab.runtime.files import UnreadableFile
from lab.training.plan import plan_run
from sweeps.cli import main as sweeps_main

SWEEP = """shapes = { aspect = 32, width_multiple = 64, head_dim = 64 }
rules = { lr = 2e-3, batch_tokens = 16384 }
base = { model = { block_size = 256 }, data = { vocab_size = 4096 } }
[sweep]
name = "fuzz"
budgets = [1e13, 3e13]
sizes = [3e5, 1e6]
[slurm]
partition = "gpu"
"""
CONFIG = """[model]
n_layer = 2
n_head = 2
d_model = 32
block_size = 32
[train]
tokens = 2048
batch_tokens = 256
micro_batch = 4
lr = 1e-2
"""
HF_CONFIG = json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 16,
                        "n_positions": 32, "layer_norm_epsilon": 1e-5})
HOSTILE = ["\n", "\r", "\x00", "\x85", "\u2028", "\u2029", "\x7f", "\x1b[2J", "1e308", "-1", "0", "nan", "inf",
           "1e999", '"3"', "[]", "{}", "true", "9" * 40, "[" * 300, "\ufeff", "../../outside", "/etc/passwd",
           "\\u0000", "x" * 300, "'", '"""', "=", "[sweep]", "#SBATCH --uid=0"]
PER_INPUT_S = 20  # an input taking longer counts as a hang
REFUSALS = (ConfigError, InputError, UnreadableFile)


def mutate(text: str, rng: random.Random) -> bytes:
    """``text`` changed in one to three ways: a hostile token put in or swapped for a value, bytes flipped, cut, or
    a span repeated."""
    data = text.encode()
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(5)
        at = rng.randrange(len(data) + 1)
        if kind == 0:  # a hostile token at a random place
            data = data[:at] + rng.choice(HOSTILE).encode() + data[at:]
        elif kind == 1:  # a value (after '=' or ':') replaced by a hostile token
            marks = [i for i, b in enumerate(data) if b in b"=:"]
            if marks:
                i = rng.choice(marks) + 1
                end = min((j for j in (data.find(b"\n", i), data.find(b",", i), data.find(b"}", i)) if j >= 0),
                          default=len(data))
                data = data[:i] + b" " + rng.choice(HOSTILE).encode() + data[end:]
        elif kind == 2 and data:  # a byte flipped
            i = rng.randrange(len(data))
            data = data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
        elif kind == 3:  # cut short
            data = data[:at]
        else:  # a span repeated
            j = rng.randrange(at, len(data) + 1)
            data = data[:j] + data[at:j] + data[j:]
    return data


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def hang(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _sweep(path: Path, data: bytes, capsys) -> bool:
    """Whether ``sweeps plan`` accepted the file (False: refused in its lines, checked here)."""
    path.write_bytes(data)
    code = sweeps_main(["plan", str(path), "--folder", str(path.parent / "sweep")])
    err = capsys.readouterr().err.strip().splitlines()
    # a plan refuses each run it cannot plan on its own line (``sweeps.cli._refuse``); nothing else is printed
    assert code == 0 or (err and all(line.startswith(("error: ", "warning: ")) for line in err)), (code, err)
    return code == 0


def _config(path: Path, data: bytes, capsys) -> None:
    path.write_bytes(data)
    args = run_parser().parse_args(["--config", str(path)])
    cfg = config_from_args(args)
    plan_run(cfg, 1)  # every check of a run's config, the model's first


def _table(suffix: str) -> Callable:
    def check(path: Path, data: bytes, capsys) -> None:
        table = path.with_suffix(suffix)
        table.write_bytes(data)
        load_runs(table)
    return check


def _hf(path: Path, data: bytes, capsys) -> None:
    path.write_bytes(data)
    hf.model_config(hf.read_import_json(path), str(path))


def _seeds() -> dict[str, tuple[str, Callable]]:
    frame = isoflop_runs((1e17, 3e17), per_budget=5, spread=6, noise=0.005, seed=0)
    jsonl = "\n".join(json.dumps(r) for r in frame.to_dict(orient="records")) + "\n"
    return {"sweep file": (SWEEP, _sweep), "run config": (CONFIG, _config), "CSV table": (frame.to_csv(index=False),
            _table(".csv")), "JSONL table": (jsonl, _table(".jsonl")), "HF config": (HF_CONFIG, _hf)}


def fuzz(kind: str, count: int, seed: int, root: Path, capsys) -> tuple[int, int]:
    """Try ``count`` mutations of ``kind``'s valid file; returns (accepted, refused). Fails on anything else."""
    text, check = _seeds()[kind]
    rng = random.Random(f"{kind}-{seed}")
    folder = root / kind.replace(" ", "-")
    folder.mkdir()
    accepted = refused = 0
    for i in range(count):
        data = mutate(text, rng)
        try:
            with deadline(PER_INPUT_S):
                ok = check(folder / "input", data, capsys)
            accepted, refused = (accepted + 1, refused) if ok is not False else (accepted, refused + 1)
        except REFUSALS as e:
            assert len(str(e).strip().splitlines()) == 1, (kind, i, data[:200], str(e))
            refused += 1
        except SystemExit as e:  # argparse's refusal: one line
            assert e.code == 2, (kind, i, data[:200], e.code)
            refused += 1
        except Exception as e:  # a traceback the user would see
            raise AssertionError(f"{kind} input {i} (seed {seed}) raised {type(e).__name__}: {e}; input "
                                 f"{data[:300]!r}") from e
        written = sorted(p.name for p in folder.iterdir())
        assert set(written) <= {"input", "input.csv", "input.jsonl"}, (kind, i, written)  # nothing written
    return accepted, refused


KINDS = ["sweep file", "run config", "CSV table", "JSONL table", "HF config"]


@pytest.mark.parametrize("kind", KINDS)
def test_fuzzed_inputs_end_in_one_line_or_work(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accepted, refused = fuzz(kind, 60, 0, tmp_path, capsys)
    assert accepted + refused == 60 and refused > 0  # the mutations reach the checks
    assert sorted(p.name for p in tmp_path.iterdir()) == [kind.replace(" ", "-")]


@pytest.mark.long
def test_fuzzed_inputs_long(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    count = int(os.environ.get("LAB_FUZZ_INPUTS", "2500"))
    started, totals = time.perf_counter(), {}
    for kind in KINDS:
        totals[kind] = fuzz(kind, count, 1, tmp_path, capsys)
    with capsys.disabled():
        print(f"\nfuzz: {sum(a + r for a, r in totals.values())} inputs in {time.perf_counter() - started:.0f} s: "
              + ", ".join(f"{k} {a} accepted / {r} refused" for k, (a, r) in totals.items()))
