"""Checkpoints that reshard, and runs that survive a dead rank, on real gloo ranks and real torchrun."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab.runtime import checkpoint
from lab.commands.cli import export_main, sample_main
from lab.training.lifecycle import build_engine, resolve_vocab, train
from lab.training.plan import plan_run
from lab.runtime.config import build_parser, config_from_args, resolve
from lab.data import load_tokenizer, prepare
from lab.measure.device import Precision
from lab.parallel import World
from lab.commands.ranks import RankFailed, free_port, run_ranks
from pool import run_pooled

pytestmark = pytest.mark.slow  # launches processes or trains many runs: `make test` only, not test-fast

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tree(tiny_corpus, tiny_cache_dir, tiny_prepared):
    """The tiny run as a config tree: 8 steps of 8 sequences of 32 tokens, a checkpoint only where a run stops
    (train.stop_after) or ends: each save is a collective that costs more than a step."""
    return {"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32, "vocab_size": 512},
            "data": {"corpus": str(tiny_corpus), "cache_dir": str(tiny_cache_dir), "vocab_size": 512},
            "train": {"tokens": 2048, "batch_tokens": 256, "micro_batch": 4, "lr": 1e-2, "eval_tokens": 64,
                      "checkpoint_every": 0}}


def with_(tree: dict, strategy: str, **train) -> dict:
    return {**tree, "train": {**tree["train"], **train}, "parallel": {"strategy": strategy}}


def _train(world: World, tree: dict, data_dir: Path, run_dir: Path, resume: bool) -> int:
    return train(resolve(tree), data_dir, run_dir, world, resume=resume)["steps"]


def train_argv(world: World, argv: list[str], run_dir: Path) -> str:
    """What launch/run.py does on each rank once the group is up: parse, prepare, train; the final status."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args([*argv, "--run-dir", str(run_dir)]))
    data_dir = prepare(cfg.data, progress=False)
    resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
    return train(cfg, data_dir, run_dir, world)["status"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in checkpoint.load_everything(checkpoint.latest(run_dir)).items() if k.startswith("model/")}


def nproc(strategy: str, n: int) -> int:
    return 1 if strategy == "single" else n


def segment(tree, data_dir, run_dir, strategy, n, resume, **train_opts) -> int:
    """One run segment under ``strategy`` on ``n`` ranks (4 ranks need smaller micro-batches)."""
    opts = {"micro_batch": 2, **train_opts} if n == 4 else train_opts
    return run_pooled(_train, nproc(strategy, n), with_(tree, strategy, **opts), data_dir, run_dir, resume)[0]


@pytest.fixture(scope="module")
def uninterrupted(tree, tiny_prepared, tmp_path_factory):
    """Final weights of whole runs: single on 1 process, zero3 and zero2 on 2 ranks."""
    out = {}
    for strategy, n in (("single", 1), ("zero3", 2), ("zero2", 2)):
        run_dir = tmp_path_factory.mktemp(f"whole-{strategy}")
        assert segment(tree, tiny_prepared, run_dir, strategy, n, False) == 8
        out[strategy] = final_weights(run_dir)
    return out


@pytest.mark.parametrize("saved, resumed", [
    (("zero3", 2), ("zero2", 4)), (("zero2", 2), ("single", 1)), (("zero1", 2), ("fsdp", 2)),
    (("fsdp", 2), ("zero3", 4)), (("ddp", 2), ("zero1", 2)), (("torch_ddp", 2), ("ddp", 4)),
])
def test_a_run_resumes_under_another_strategy_and_world_size(tree, tiny_prepared, tmp_path, uninterrupted, saved,
                                                             resumed):
    run_dir = tmp_path / "r"
    assert segment(tree, tiny_prepared, run_dir, *saved, False, stop_after=4) == 4
    assert segment(tree, tiny_prepared, run_dir, *resumed, True) == 8
    got, ref = final_weights(run_dir), uninterrupted["single"]
    assert got.keys() == ref.keys()
    # the equivalence tolerance: regrouped fp32 sums carried by AdamW (tests/test_distributed.py)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-3


def test_the_same_strategy_and_world_size_resume_bit_for_bit(tree, tiny_prepared, tmp_path, uninterrupted):
    run_dir = tmp_path / "r"
    assert segment(tree, tiny_prepared, run_dir, "zero3", 2, False, stop_after=3) == 3
    assert segment(tree, tiny_prepared, run_dir, "zero3", 2, True) == 8
    got, ref = final_weights(run_dir), uninterrupted["zero3"]
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    everything = checkpoint.load_everything(checkpoint.latest(run_dir))
    assert everything["optim/wte.weight/step"] == 8 and "optim/wte.weight/exp_avg_sq" in everything


# ---------------------------------------------------------------- a process killed while writing


def _dies_while_saving_step_4(world: World, tree: dict, data_dir: Path, run_dir: Path, point: str) -> int:
    import torch.distributed.checkpoint.filesystem as fs

    from lab.runtime import checkpoint as ckpt

    def die() -> None:
        os._exit(9)

    if point == "parts" and world.rank == 1:
        write = fs.FileSystemWriter.write_data
        fs.FileSystemWriter.write_data = lambda self, plan, planner: (
            die() if "step-000004" in str(self.path) else write(self, plan, planner))
    if point == "marker" and world.rank == 0:
        save_json = ckpt.save_json
        ckpt.save_json = lambda path, obj: die() if "step-000004" in str(path) else save_json(path, obj)
    if point == "rename" and world.rank == 0:
        replace = Path.replace
        Path.replace = lambda self, target: die() if self.name == "step-000004.tmp" else replace(self, target)
    return _train(world, tree, data_dir, run_dir, False)


@pytest.mark.long
@pytest.mark.parametrize("point", ["parts", "marker", "rename"])
def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one(tree, tiny_prepared, tmp_path,
                                                                             uninterrupted, point):
    run_dir, zero2 = tmp_path / "r", with_(tree, "zero2", checkpoint_every=1)  # step 3's is the one left
    with pytest.raises(RankFailed, match="exit code 9|died|rank"):
        run_ranks(_dies_while_saving_step_4, 2, zero2, tiny_prepared, run_dir, point, timeout_s=10)
    assert checkpoint.latest(run_dir).name == "step-000003"
    assert segment(tree, tiny_prepared, run_dir, "zero2", 2, True) == 8
    got = final_weights(run_dir)
    assert all(torch.equal(got[k], uninterrupted["zero2"][k]) for k in got)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the half-written folder was cleaned up


# ---------------------------------------------------------------- export and sampling


def _gathered(world: World, tree: dict, run_dir: Path) -> dict[str, torch.Tensor]:
    cfg = resolve(tree)
    strategy = build_engine(plan_run(cfg, world.world_size, Precision("cpu")), world)
    checkpoint.load(checkpoint.latest(run_dir), world.rank, world.world_size, strategy.checkpoint_state())
    strategy.after_load()
    return strategy.full_state_dict()


@pytest.mark.long
@pytest.mark.parametrize("strategy", ["single", "ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_export_and_sample_from_any_strategy(tree, tiny_prepared, tmp_path, strategy, capsys):
    run_dir, short = tmp_path / "r", with_(tree, strategy, tokens=512)
    n = nproc(strategy, 2)
    assert run_pooled(_train, n, short, tiny_prepared, run_dir, False)[0] == 2
    gathered = run_pooled(_gathered, n, short, run_dir)[0]
    assert export_main([str(run_dir), "--out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported["step"] == 2 and exported.keys() == {"model", "config", "step"}
    assert exported["model"].keys() == {k for k in gathered if k in exported["model"]} and exported["model"]
    assert all(torch.equal(exported["model"][k], gathered[k]) for k in exported["model"])
    capsys.readouterr()
    assert sample_main(["--run-dir", str(run_dir), "--prompt", "The Union", "--tokens", "5"]) == 0
    sampled = capsys.readouterr().out
    assert sampled.startswith("The Union")
    # the run folder as an argument, as export takes it: the same run, the same seed, the same text
    assert sample_main([str(run_dir), "--prompt", "The Union", "--tokens", "5"]) == 0
    assert capsys.readouterr().out == sampled


def test_export_refuses_what_is_not_a_run(tmp_path, capsys):
    assert export_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path} is not a run directory (no config.json)"


# ---------------------------------------------------------------- a dead rank under torchrun


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the worker with ``rank`` training into ``run_dir``, found in /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir).encode() in cmdline and f"RANK={rank}".encode() in environ and b"launch/run.py" in cmdline:
            return int(entry.name)
    return None


def torchrun(*argv: str, restarts: int = 0) -> subprocess.Popen:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with its store shared, a restarted group can read the previous
    # attempt's addresses and fail to connect (pytorch/pytorch#135712; the README says so)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             f"--max-restarts={restarts}", "launch/run.py", *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


@pytest.mark.long
def test_a_rank_killed_mid_run_is_restarted_by_torchrun_and_the_run_finishes(args, tmp_path):
    long = [*args, "--strategy", "zero2", "--train.tokens", "8192", "--train.checkpoint_every", "4"]  # 32 steps
    assert run_pooled(train_argv, 2, long, tmp_path / "whole") == ["completed"] * 2
    proc = torchrun(*long, "--run-dir", str(tmp_path / "r"), restarts=1)
    deadline = time.monotonic() + 120
    while not (tmp_path / "r" / "checkpoints" / "step-000008" / "meta.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    os.kill(_rank_pid(tmp_path / "r", 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = __import__("json").loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 1 and summary["resumed_from_step"] >= 8
    got, ref = final_weights(tmp_path / "r"), final_weights(tmp_path / "whole")
    assert all(torch.equal(got[k], ref[k]) for k in ref)


# ---------------------------------------------------------------- failing fast


def wait_for(predicate, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.mark.long
def test_a_missing_rank_fails_with_one_line_within_the_timeout(args, tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "launch/run.py", *args, "--strategy", "ddp", "--parallel.timeout_s", "3",
                           "--run-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1 and time.monotonic() - start < 60
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the 2 processes did not meet within parallel.timeout_s "
                                                   "(3 s), is a rank missing?")


@pytest.mark.long
def test_a_frozen_rank_ends_the_run_within_the_timeout(args, tmp_path):
    proc = torchrun(*args, "--strategy", "ddp", "--train.tokens", "8192", "--parallel.timeout_s", "5",
                    "--run-dir", str(tmp_path / "r"))
    for line in proc.stdout:
        if line.startswith("step     2/"):
            break
    wait_for(lambda: _rank_pid(tmp_path / "r", 1), 30)  # one scan of /proc can miss it on a busy machine
    frozen = _rank_pid(tmp_path / "r", 1)
    os.kill(frozen, signal.SIGSTOP)
    start = time.monotonic()
    wait_for(lambda: (tmp_path / "r" / "logs" / "rank-0-error.txt").is_file() or proc.poll() is not None, 60)
    assert time.monotonic() - start < 30
    # torchrun now stops the group; a stopped process would sit on its SIGTERM for torchrun's 30 s grace
    os.kill(frozen, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    # the line names the dp axis when rank 0 waits in a collective on it (the gradients' all-reduce, where rank 1
    # stops in most runs) and is the generic one when it waits in a collective of the whole group
    assert re.search(r"error: rank 0: (a rank on the dp axis died or did not answer within|a collective failed or "
                     r"timed out after) parallel\.timeout_s \(5 s\)", err)
    assert (tmp_path / "r" / "logs" / "rank-0-error.txt").is_file()


@pytest.mark.long
def test_ranks_with_different_configs_fail_at_once(args, tmp_path):
    """As if rank 1 had read another config file: both ranks end at once; the node's first rank names the
    mismatch in one line (the others stay quiet, so the user reads it once)."""
    wrapper = tmp_path / "skewed.py"
    wrapper.write_text("import os, sys\nfrom lab.commands.cli import run_main\n"
                       "extra = ['--train.seed', '7'] if os.environ['RANK'] == '1' else []\n"
                       "sys.exit(run_main(sys.argv[1:] + extra))\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(wrapper), *args, "--strategy", "ddp", "--run-dir", str(tmp_path / "r")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("error: the config differs between ranks: rank 1 has") == 1
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
