"""Nothing lost, nobody let in (issue 32): runs under faults, races and hostile input.

Each test failed on the code before its fix.
"""

import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch

from lab.runtime import checkpoint
from lab.commands.cli import export_main, run_main, sample_main
from lab.training.lifecycle import build_engine, resolve_vocab, restore, train
from lab.runtime.config import ConfigError, ParallelConfig, build_parser, config_from_args
from lab.data import load_tokenizer, prepare
from lab.measure.device import Precision
from lab.runtime.files import save_json, take_lock
from lab.parallel import World
from lab.commands.ranks import run_ranks
from lab.training.plan import plan_run


def run(run_dir: Path, *argv: str) -> int:
    return run_main([*argv, "--run-dir", str(run_dir)])


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def train_in_process(argv: list[str], run_dir: Path, **kwargs) -> dict:
    """What launch/run.py does in one process once its checks passed: parse, prepare, train; the summary."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args([*argv, "--run-dir", str(run_dir)]))
    data_dir = prepare(cfg.data, progress=False)
    resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
    return train(cfg, data_dir, run_dir, World(0, 1, 0, torch.device("cpu")), **kwargs)


# ---------------------------------------------------------------- a finished run is finished


@pytest.mark.slow
def test_a_stop_signal_during_the_last_step_completes_the_run(args, tmp_path):
    calls = {"n": 0}

    def sigterm_in_step_8() -> int:  # asked once per step
        calls["n"] += 1
        return signal.SIGTERM if calls["n"] >= 8 else 0

    r = tmp_path / "r"
    s = train_in_process([*args], r, stop_signal=sigterm_in_step_8)
    assert calls["n"] >= 8 and s["status"] == "completed" and s["steps"] == 8
    assert summary(r)["status"] == "completed"


@pytest.mark.slow
def test_a_run_killed_between_its_last_checkpoint_and_its_summary_completes_on_resume(args, finished_run, tmp_path,
                                                                                     capsys):
    r, whole = tmp_path / "r", tmp_path / "whole"
    assert run(whole, *args, "--train.stop_after", "3") == 0  # skipped_steps and losses carried from step 3 on
    assert run(whole, *args, "--resume") == 0
    expected = summary(whole)
    shutil.copytree(finished_run, r)
    (r / "summary.json").unlink()  # what a SIGKILL right after the final save leaves
    capsys.readouterr()
    assert run(r, *args, "--resume", "auto") == 0, capsys.readouterr().err
    got = summary(r)
    assert got["status"] == "completed" and got["steps"] == 8 and got["resumed_from_step"] == 8
    for key in ("final_train_loss", "final_eval_loss", "skipped_steps"):
        assert got[key] == expected[key], key


@pytest.mark.slow
def test_skipped_steps_count_across_resumes(args, tmp_path, infinite_gradient_at_step_3):
    r = tmp_path / "r"
    assert run(r, *args, "--train.stop_after", "4") == 0
    assert summary(r)["skipped_steps"] == 1
    assert run(r, *args, "--resume") == 0  # the poisoned micro-steps (the 5th and 6th forwards) are behind
    assert summary(r)["skipped_steps"] == 1


# ---------------------------------------------------------------- ranks agree on what they resume


def _resume_with_a_stale_view_on_rank_1(world: World, argv: list[str], run_dir: Path) -> tuple[int, str]:
    """Rank 1 lists the checkpoints as a node with a stale cache would (without the newest), then reads another
    meta.json than rank 0 for the same checkpoint; the step each rank resumed at, and the error of the second."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args([*argv, "--parallel.strategy", "ddp"]))
    resolve_vocab(cfg, 512)
    run = plan_run(cfg, world.world_size, Precision(world.device.type))
    strategy, plan = build_engine(run, world), run.steps
    if world.rank == 1:
        dirs = checkpoint.checkpoint_dirs
        checkpoint.checkpoint_dirs = lambda run_dir: dirs(run_dir)[:-1]
    step = restore(strategy, run_dir, world, cfg, plan).step
    if world.rank == 1:
        read = checkpoint.read_plain
        checkpoint.read_plain = lambda path, *a, **kw: (read(path, *a, **kw).replace(b'"tokens"', b'"tokens" ')
                                                        if path.name == "meta.json" else read(path, *a, **kw))
    try:
        restore(strategy, run_dir, world, cfg, plan)
        return step, ""
    except ConfigError as e:
        return step, str(e)


@pytest.mark.slow
def test_rank_0_picks_the_checkpoint_and_every_rank_checks_it(args, tmp_path):
    r = tmp_path / "r"
    assert run(r, *args, "--train.checkpoint_every", "2", "--train.stop_after", "4") == 0
    assert [p.name for p in checkpoint.checkpoint_dirs(r)] == ["step-000002", "step-000004"]
    results = run_ranks(_resume_with_a_stale_view_on_rank_1, 2, [*args, "--run-dir", str(r)], r)
    assert [step for step, _ in results] == [4, 4]
    assert all("checkpoint step-000004 (its metadata as each rank reads it) differs between ranks" in error
               for _, error in results), results


# ---------------------------------------------------------------- one writer per run folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_second_launch_on_a_folder_in_use_refuses_and_touches_nothing(args, tmp_path, capsys):
    r = tmp_path / "r"
    assert run(r, *args, "--train.stop_after", "4") == 0
    with take_lock(r / ".lock"):  # what the first run's rank 0 holds while it runs
        before = snapshot(r)
        capsys.readouterr()
        assert run(r, *args, "--resume", "auto") == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"{r} is in use by another run (pid {os.getpid()})" in line
        assert snapshot(r) == before
    assert run(r, *args, "--resume", "auto") == 0  # the lock goes with the process that held it


# ---------------------------------------------------------------- issue 48: finished stays finished, a lock stays a lock


@pytest.mark.slow
def test_a_completed_run_whose_checkpoints_were_removed_is_not_trained_again(args, finished_run, tmp_path, capsys):
    r = tmp_path / "r"
    shutil.copytree(finished_run, r)
    shutil.rmtree(r / "checkpoints")  # a user freeing disk, a scratch purge
    before = snapshot(r)
    capsys.readouterr()
    assert run(r, *args, "--resume", "auto") == 2
    assert f"--resume: the run in {r} is already complete (8 steps)" in one_error_line(capsys.readouterr().err)
    assert snapshot(r) == before  # summary.json and metrics.jsonl as they were


def test_a_lock_that_is_a_link_is_refused_and_its_target_left_alone(args, tmp_path, capsys):
    from sweeps.driver import driver_lock
    from sweeps.registry import RegistryError

    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    r, sweep = tmp_path / "r", tmp_path / "sweep"
    for folder, name in ((r, ".lock"), (sweep, ".driver.lock")):
        folder.mkdir()
        (folder / name).symlink_to(target)
    assert run(r, *args) == 2
    assert f"the lock {r / '.lock'} is a symbolic link" in one_error_line(capsys.readouterr().err)
    with pytest.raises(RegistryError, match="is a symbolic link"), driver_lock(sweep):
        pass
    (sweep / ".driver.lock").unlink()
    os.link(target, sweep / ".driver.lock")  # a hard link would have its other name truncated just the same
    with pytest.raises(RegistryError, match="is not a plain file of one name"), driver_lock(sweep):
        pass
    assert target.read_text() == "keep me\n" and not (r / "metrics.jsonl").exists()


def test_a_file_system_that_refuses_locks_gets_one_line(args, tmp_path, capsys, monkeypatch):
    import errno
    import fcntl

    from sweeps.driver import driver_lock
    from sweeps.registry import RegistryError

    def refused(fd, operation):  # flock on some Lustre and FUSE mounts
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    assert run(tmp_path / "r", *args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"the file system of {tmp_path / 'r' / '.lock'} refuses locks (No locks available)" in line, line
    with pytest.raises(RegistryError, match="refuses locks"), driver_lock(tmp_path / "sweep"):
        pass


def _restore_on(world: World, argv: list[str], run_dir: Path) -> str:
    """Resume ``run_dir`` under ddp on this world: the error each rank meets ('' for none)."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args([*argv, "--parallel.strategy", "ddp"]))
    resolve_vocab(cfg, 512)
    strategy = build_engine(plan_run(cfg, world.world_size, Precision(world.device.type)), world)
    try:
        restore(strategy, run_dir, world, cfg, plan_run(cfg, world.world_size).steps)
        return ""
    except ConfigError as e:
        return str(e)


@pytest.mark.slow
def test_a_refusal_on_rank_0_while_choosing_the_checkpoint_reaches_every_rank(args, finished_run, tmp_path):
    r = tmp_path / "r"
    shutil.copytree(finished_run, r)
    (r / "checkpoints" / "step-000008" / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    errors = run_ranks(_restore_on, 2, [*args, "--run-dir", str(r)], r, timeout_s=10)
    assert errors[0] == errors[1] and "is refused: its .metadata asks for posix.system" in errors[0], errors


# ---------------------------------------------------------------- durable writes


def test_write_atomic_syncs_the_file_and_its_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd)))
    save_json(tmp_path / "x.json", {"a": 1})
    assert synced == [(tmp_path / "x.json").stat().st_ino, tmp_path.stat().st_ino]


@pytest.mark.slow
def test_a_checkpoint_with_unreadable_metadata_falls_back_to_the_previous_one(args, finished_run, tmp_path,
                                                                           capsys):
    whole, stopped, r = finished_run, tmp_path / "stopped", tmp_path / "r"
    assert run(stopped, *args, "--train.checkpoint_every", "2", "--train.stop_after", "4") == 0
    for broken in (".metadata", "meta.json"):
        shutil.rmtree(r, ignore_errors=True)
        shutil.copytree(stopped, r)
        (r / "checkpoints" / "step-000004" / broken).write_bytes(b"\x80\x04truncated")
        capsys.readouterr()
        assert run(r, *args, "--resume") == 0
        err = capsys.readouterr().err
        assert f"warning: checkpoint {r / 'checkpoints' / 'step-000004'} is unreadable" in err, err
        assert summary(r)["resumed_from_step"] == 2
        assert summary(r)["final_eval_loss"] == summary(whole)["final_eval_loss"]


# ---------------------------------------------------------------- loading is not executing


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.slow
def test_a_crafted_checkpoint_is_refused_without_running_anything(args, tmp_path, capsys):
    r, marker = tmp_path / "r", tmp_path / "pwned"
    assert run(r, *args, "--train.stop_after", "4") == 0
    (r / "checkpoints" / "step-000004" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    capsys.readouterr()
    for refused in (lambda: export_main([str(r)]), lambda: sample_main(["--run-dir", str(r), "--tokens", "2"]),
                    lambda: run(r, *args, "--resume")):
        assert refused() == 2
        assert not marker.exists()  # the pickle's payload never ran
        line = one_error_line(capsys.readouterr().err)
        assert "is refused: its .metadata asks for posix.system, which is not a type DCP writes" in line, line


# ---------------------------------------------------------------- input that must not crash


@pytest.mark.parametrize("content, option, message", [
    (b"model = 3\n", (), "'model' must be a table ([model]), got 3"),
    (b"\xff\xfe[train]\n", (), "is not UTF-8 text (byte 0)"),
    (b"", ("--train.lr", "nan"), "train.lr: expected a finite float, got 'nan'"),
    (b"", ("--parallel.timeout_s", "inf"), "parallel.timeout_s: expected a finite float, got 'inf'"),
    (b"[train]\nbeta2 = inf\n", (), "train.beta2: expected a finite float, got inf"),
    (b"", ("--train.beta1", "1"), "train.beta1 must be in [0, 1), got 1.0"),
    (b"", ("--train.beta2", "-0.5"), "train.beta2 must be in [0, 1), got -0.5"),
])
def test_bad_config_values_get_one_line_and_write_nothing(args, tmp_path, capsys, content, option, message):
    config, r = tmp_path / "c.toml", tmp_path / "r"
    config.write_bytes(content)
    assert run(r, *args, "--config", str(config), *option) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not r.exists()


def test_sweep_names_files_and_slurm_settings_are_checked(tmp_path):
    from sweeps import spec
    from sweeps.executors.attempt import Attempt
    from sweeps.executors.slurm import sbatch_options

    with pytest.raises(spec.SpecError, match="got 'run\\\\n'"):
        spec.check_name("run\n", "name")  # a full match: '$' would let the newline through
    binary = tmp_path / "sweep.toml"
    binary.write_bytes(b"[sweep]\nname = \"\xff\"\n")
    with pytest.raises(spec.SpecError, match="is not UTF-8 text"):
        spec.load(binary)
    for key, value in (("partition", "gpu\n#SBATCH --uid=0"), ("account", "a b"), ("qos", "x;y"),
                       ("constraint", "h100$(id)")):
        with pytest.raises(spec.SpecError, match="holds characters SLURM would not read as written"):
            spec.with_overrides(spec.Sweep.__new__(spec.Sweep), {}, {key: value})
    attempt = Attempt(run=None, run_dir=tmp_path, log=tmp_path / "logs" / "100%-run" / "attempt-1.log", lock=tmp_path)
    assert sbatch_options(attempt)[0] == f"--output={tmp_path}/logs/100%%-run/attempt-1.log"


# ---------------------------------------------------------------- a disk that fills up mid-checkpoint


@pytest.mark.slow
def test_a_full_disk_mid_checkpoint_stops_the_run_and_keeps_the_previous_one(args, finished_run, tmp_path, monkeypatch,
                                                                            capsys):
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    whole, r = finished_run, tmp_path / "r"
    write = fs.FileSystemWriter.write_data

    def disk_full_at_step_4(self, plan, planner):
        if "step-000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, plan, planner)

    with monkeypatch.context() as m:
        m.setattr(fs.FileSystemWriter, "write_data", disk_full_at_step_4)
        capsys.readouterr()
        assert run(r, *args, "--train.checkpoint_every", "2") == 1
    line = one_error_line(capsys.readouterr().err)
    assert "checkpoint step-000004 could not be written (OSError: [Errno 28] No space left on device)" in line, line
    assert "step-000002 is kept" in line
    assert [p.name for p in (r / "checkpoints").iterdir()] == ["step-000002"]  # no half-written folder
    assert run(r, *args, "--train.checkpoint_every", "2", "--resume") == 0  # space is back
    assert summary(r)["resumed_from_step"] == 2
    assert summary(r)["final_eval_loss"] == summary(whole)["final_eval_loss"]


# ---------------------------------------------------------------- collectives time out


def _axis_timeouts(world: World) -> list[float]:
    from lab.parallel import Layout

    n = world.world_size
    axes, experts = (Layout.of(ParallelConfig(tp=2), n).mesh(world), Layout.of(ParallelConfig(ep=2), n).mesh(world))
    timeouts = [axis.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for axis in (axes.dp, axes.tp, experts.ep, experts.edp)]
    # rank 0 holds the store: returning (and tearing it down) while a peer still reads it to finish its groups
    # resets the peer's connection
    torch.distributed.barrier()
    return timeouts


@pytest.mark.slow
def test_every_mesh_axis_gets_the_run_timeout():
    assert run_ranks(_axis_timeouts, 2, timeout_s=17) == [[17.0] * 4] * 2


RANK_DIES = """
import os, sys, time
from pathlib import Path
from lab.model import GPT
from lab.commands.cli import run_main

run_blocks, metrics = GPT.run_blocks, Path(os.environ["METRICS"])

def dies_in_step_3(self, *args, **kwargs):  # its first pass through blocks once rank 0 has logged step 2
    if os.environ["RANK"] == "1" and metrics.exists() and '"step": 2,' in metrics.read_text():
        if os.environ["FAULT"] == "hang":  # alive, connections open, never answering
            time.sleep(3600)
        os._exit(9)
    return run_blocks(self, *args, **kwargs)

GPT.run_blocks = dies_in_step_3
sys.exit(run_main(sys.argv[1:]))
"""


@pytest.mark.long
@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("axis, fault", [("dp", "exit"), ("tp", "exit"), ("tp", "hang"), ("pp", "exit"),
                                         ("pp", "hang"), ("ep", "exit"), ("ep", "hang")])
def test_a_dead_rank_on_any_axis_fails_the_survivor_within_the_timeout_naming_the_axis(axis, fault, args, tmp_path):
    """Two data-parallel ranks (the survivor blocked in the gradients' all-reduce), two ranks on one tensor-parallel
    axis, or two pipeline stages (blocked in a point-to-point receive mid-schedule), or one expert-parallel group
    (blocked in a MoE layer's exchange), started without torchrun (whose agent would stop the survivor itself, as a
    node's agent never does for ranks on other nodes): rank 1 exits, or hangs, in step 3."""
    import subprocess
    import sys
    import time

    from lab.commands.ranks import free_port

    script = tmp_path / "rank_dies.py"
    script.write_text(RANK_DIES)
    port, timeout_s = free_port(), 8
    moe = ["--model.moe_experts", "2"] if axis == "ep" else []
    degree = [f"--parallel.{axis}", "2"] if axis != "dp" else []  # dp: the ranks left, both
    procs = [subprocess.Popen([sys.executable, str(script), *args, *moe, "--strategy", "ddp", *degree,
                               "--parallel.timeout_s", str(timeout_s), "--run-dir", str(tmp_path / "r")],
                              cwd=Path(__file__).resolve().parents[1], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "FAULT": fault,
                                   "METRICS": str(tmp_path / "r" / "metrics.jsonl")})
             for r in range(2)]
    try:
        metrics = tmp_path / "r" / "metrics.jsonl"  # rank 0 writes a line per step: step 2's, then rank 1 stops
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and procs[1].poll() is None and (
                not metrics.exists() or '"step": 2,' not in metrics.read_text()):
            time.sleep(0.05)
        died = time.monotonic()  # at most a step's time before rank 1 stops answering
        code = procs[0].wait(timeout=timeout_s + 60)
        waited = time.monotonic() - died
        err = procs[0].stderr.read()
        assert procs[1].poll() == (9 if fault == "exit" else None)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert code == 1 and waited < timeout_s + 10, (code, waited, err)
    line = one_error_line(err)
    assert line.startswith(f"error: rank 0: a rank on the {axis} axis died or did not answer within parallel.timeout_s "
                           "(8 s)"), line
