"""Chaos (issue 48): a tiny sweep killed once in each named window and checked as the benchmark checks it
(benchmarks/chaos/harness.py); the checks themselves catch a run trained twice; a power cut in the middle of a
checkpoint keeps what was synced, and the run resumes from it; ranks die with their torchrun agent."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.commands.cli import run_main
from lab.runtime import chaos

REPO = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("chaos_harness", REPO / "benchmarks" / "chaos" / "harness.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the harness, seeded, on a tiny sweep

# One kill per window, each at a kind of process: the driver stopped inside a transaction, everything at once
# between an attempt's record and its start, a torchrun agent while its rank writes a checkpoint, the driver
# between a summary and its record.
KILLS = ["registry-transaction/stopped", "submit-record/everything", "checkpoint-write/agent", "summary-written/driver"]


@pytest.mark.slow
def test_a_kill_in_every_window_leaves_every_run_done_once_bitwise_and_no_process_behind(tmp_path):
    harness = _harness()  # one run of 2 ranks, 9 steps with a checkpoint every 2: each window and kind of process
    file = harness.write_sweep(tmp_path, harness.shapes((32,)), (6e8,))
    passes = harness.count_passes(file, tmp_path / "ref")
    assert all(passes[window] for window in chaos.POINTS), passes  # the undisturbed sweep passes every window
    chaos_run = harness.Chaos(file, random.Random(48), passes, list(KILLS), round_s=300)
    for attempt in range(2):  # a kill whose pass the sweep never reached is tried again in a fresh round
        folder = tmp_path / f"chaos-{attempt + 1}"
        chaos_run.round(folder, math.inf)
        result = harness.check(tmp_path / "ref", folder)
        assert result["problems"] == [] and result["runs"] == 1, result
        if not chaos_run.schedule:
            break
    made = [f"{k['window']}/{k['target']}" for k in chaos_run.log]
    assert made == KILLS and chaos_run.schedule == [], chaos_run.log


def test_the_checks_catch_a_run_trained_twice_or_completed_by_an_unrecorded_attempt():
    harness = _harness()
    registered = [{"number": 1, "outcome": None}, {"number": 2, "outcome": "done"}]
    once = [{"event": "start", "step": 0, "sweep_attempt": "1"}, {"event": "checkpoint", "step": 4},
            {"event": "start", "step": 4, "sweep_attempt": "2"}, {"event": "checkpoint", "step": 8},
            {"event": "end", "step": 8, "status": "completed"}]
    assert harness.attempt_problems("r", registered, once) == []
    from_scratch = [*once[:2], {**once[2], "step": 0}, *once[3:]]  # the same losses, the work done twice
    assert harness.attempt_problems("r", registered, from_scratch) == [
        "r: an attempt started at step 0 after step 4 was sealed"]
    again = [*once, {"event": "start", "step": 0, "sweep_attempt": "2"}, *once[3:]]  # a completed run retrained
    assert "r: attempts.jsonl has 2 completed end(s), the last record end" in harness.attempt_problems(
        "r", registered, again)
    unrecorded = [*once[:2], {**once[2], "sweep_attempt": "3"}, *once[3:]]
    assert harness.attempt_problems("r", registered, unrecorded) == ["r: an attempt (3) the registry did not record"]
    twice_done = [{"number": 1, "outcome": "done"}, {"number": 2, "outcome": "done"}]
    assert harness.attempt_problems("r", twice_done, once) == ["r: registry attempt outcomes ['done', 'done']"]


# ---------------------------------------------------------------- a power cut


class Synced:
    """What a power cut would leave: each file's bytes and each folder's entries as of their last fsync (os.fsync
    wrapped); a file never synced comes back empty, an entry never synced not at all."""

    def __init__(self, fsync):
        self.real, self.files, self.folders = fsync, {}, {}

    def fsync(self, fd: int) -> None:
        info, path = os.fstat(fd), f"/proc/self/fd/{fd}"  # the file itself, even where the fd is write-only
        if stat.S_ISDIR(info.st_mode):
            self.folders[info.st_ino] = {e.name: (e.inode(), e.is_dir(follow_symlinks=False)) for e in os.scandir(path)}
        elif stat.S_ISREG(info.st_mode):
            self.files[info.st_ino] = Path(path).read_bytes()
        self.real(fd)

    def image(self, folder_inode: int, into: Path) -> None:
        into.mkdir()
        for name, (inode, is_dir) in self.folders.get(folder_inode, {}).items():
            if is_dir:
                self.image(inode, into / name)
            else:
                (into / name).write_bytes(self.files.get(inode, b""))


class PowerCut(BaseException):
    """The power went at a chaos point (nothing catches it, as nothing survives one)."""


@pytest.mark.slow
def test_a_power_cut_inside_a_checkpoint_write_keeps_what_was_synced_and_the_run_resumes_from_it(args, finished_run,
                                                                                                 tmp_path, monkeypatch):
    whole, r, image = finished_run, tmp_path / "r", tmp_path / "image"
    synced, passes = Synced(os.fsync), {"n": 0}

    def cut_in_the_second_checkpoint(name: str) -> None:  # the one of step 8, its files written, not yet sealed
        passes["n"] += name == "checkpoint-write"
        if passes["n"] == 2:
            synced.image(r.stat().st_ino, image)
            raise PowerCut

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", synced.fsync)
        m.setattr(chaos, "point", cut_in_the_second_checkpoint)
        with pytest.raises(PowerCut):
            run_main([*args, "--run-dir", str(r)])
    assert sorted(p.name for p in (image / "checkpoints").iterdir()) == ["step-000004"]
    assert run_main([*args, "--run-dir", str(image), "--resume", "auto"]) == 0
    summary = json.loads((image / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["status"] == "completed"

    def records(run_dir: Path) -> list[tuple[int, float]]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [(rec["step"], rec["loss"]) for rec in map(json.loads, lines) if "loss" in rec]

    assert records(image) == records(whole)  # every step once, bit for bit
    assert summary["final_eval_loss"] == json.loads((whole / "summary.json").read_text())["final_eval_loss"]
    events = [(e["event"], e["step"]) for e in map(json.loads, (image / "attempts.jsonl").read_text().splitlines())]
    assert events == [("start", 0), ("checkpoint", 4), ("start", 4), ("checkpoint", 8), ("end", 8)]


# ---------------------------------------------------------------- no orphans


@pytest.mark.long
@pytest.mark.slow  # a torchrun agent and two ranks
def test_ranks_die_with_their_torchrun_agent(args, tmp_path):
    r = tmp_path / "r"
    agent = subprocess.Popen([sys.executable, "-m", "lab.runtime.loopback", "--standalone", "--nproc_per_node=2",
                              str(REPO / "launch" / "run.py"), *args, "--strategy", "ddp", "--train.tokens", "204800",
                              "--run-dir", str(r)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    harness = _harness()
    try:
        deadline = time.monotonic() + 120
        while not (r / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [p for p in harness.sweep_processes(r) if harness.is_rank(p)]
        assert len(ranks) == 2 and all(harness.parent(p) == agent.pid for p in ranks), ranks
        agent.send_signal(signal.SIGKILL)  # 800 steps to go: its ranks would train on for minutes
        agent.wait()
        deadline = time.monotonic() + 5
        while harness.sweep_processes(r) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert harness.sweep_processes(r) == []
    finally:
        for pid in harness.sweep_processes(r):
            os.kill(pid, signal.SIGKILL)
    assert not (r / "summary.json").exists()
