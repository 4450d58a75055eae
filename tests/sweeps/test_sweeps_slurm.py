"""The SLURM executor against a real single-node cluster on localhost (sweeps/slurm/local_cluster.sh):
arrays, a failing run, a cancelled run, a driver killed and restarted mid-sweep, quoting, and the
multi-node sbatch script (torchrun with c10d rendezvous) run on one node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes or trains many runs: `make test` only, not test-fast


REPO = Path(__file__).resolve().parents[2]
SHAPES = [{"name": "small", "n_layer": 2, "d_model": 32, "n_head": 2},
          {"name": "mid", "n_layer": 2, "d_model": 48, "n_head": 2},
          {"name": "wide", "n_layer": 2, "d_model": 64, "n_head": 2}]
SLURM = '[slurm]\npartition = "debug"\npoll_s = 0.5\n[launch]\nmem_gb = 1\ntime_min = 10\n'


def sacct_states(job: str) -> dict[str, str]:
    """{job id: state} of a job (all tasks of an array) from SLURM's accounting."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", job], capture_output=True, text=True,
                         check=True).stdout
    return {line.split("|")[0]: line.split("|")[1] for line in out.splitlines() if line}


def job_id(row: dict) -> str:
    kind, _, job = row["job"].partition(":")
    assert kind == "slurm", row["job"]
    return job


def wait_for(predicate, timeout: float = 180, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def run_sweep(file: Path, folder: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeps", "run", str(file), "--folder", str(folder),
                           "--executor", "slurm", "--no-progress", *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.long
def test_arrays_run_every_run_with_its_own_resources(cluster, tmp_path, write_sweep, registry_rows, completions):
    # small and mid share their resources (one array of two); wide asks for another time limit (its own job)
    shapes = SHAPES[:2] + [{**SHAPES[2], "launch": {"time_min": 7}}]
    file = write_sweep(tmp_path / "s.toml", budgets=[6e8], shapes=shapes, extra=SLURM)
    folder = tmp_path / "sweep"
    proc = run_sweep(file, folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = registry_rows(folder)
    assert len(rows) == 3 and all(r["status"] == "done" and r["attempts"] == 1 for r in rows.values())
    arrays: dict[str, list[str]] = {}
    for name, row in rows.items():
        arrays.setdefault(job_id(row).split("_")[0], []).append(name.split("-", 1)[1])
    assert sorted(sorted(v) for v in arrays.values()) == [["mid", "small"], ["wide"]]
    for array, names in arrays.items():
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,Timelimit", "-j", array],
                             capture_output=True, text=True, check=True).stdout.split()
        assert len(out) == len(names)
        assert {line.split("|")[1] for line in out} == {"COMPLETED"}
        assert {line.split("|")[2] for line in out} == {"00:07:00" if names[0] == "wide" else "00:10:00"}
    for name, row in rows.items():
        assert json.loads(row["summary"])["status"] == "completed" and completions(folder, name) == 1


def test_array_parameters_carry_each_runs_resources():
    from sweeps.executors.slurm import array_parameters
    from sweeps.spec import Launch

    launch = Launch(strategy="ddp", nproc=4, cpus_per_proc=8, gpus_per_proc=1, mem_gb=64, time_min=90)
    got = array_parameters(launch, {"partition": "gpu", "account": "lab", "array_parallelism": 8}, "sweep-x")
    assert got == {"job_name": "sweep-x", "time": 90, "nodes": 1, "ntasks_per_node": 1, "cpus_per_task": 32,
                   "mem": "65536M", "array_parallelism": 8, "gpus_per_node": 4, "partition": "gpu", "account": "lab"}


@pytest.mark.long
def test_a_failing_run_is_recorded_as_failed_with_its_error_line(cluster, tmp_path, write_sweep, registry_rows,
                                                                 sweeps_cli):
    shapes = [SHAPES[0], {**SHAPES[1], "launch": {"strategy": "no-such-strategy"}}]
    file = write_sweep(tmp_path / "s.toml", budgets=[6e8], shapes=shapes, extra=SLURM)
    folder = tmp_path / "sweep"
    proc = run_sweep(file, folder)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = registry_rows(folder)
    assert rows["C6e8-small"]["status"] == "done"
    bad = rows["C6e8-mid"]
    assert bad["status"] == "failed" and bad["error"].startswith("error: unknown strategy 'no-such-strategy'")
    assert sacct_states(job_id(bad))[job_id(bad)] == "FAILED"
    assert bad["error"] in sweeps_cli("status", folder).stdout


@pytest.mark.long
def test_a_cancelled_run_is_recorded_as_cancelled(cluster, tmp_path, write_sweep, registry_rows, sweeps_cli):
    file = write_sweep(tmp_path / "s.toml", budgets=[1e11], shapes=SHAPES[:1], extra=SLURM)  # about 1,400 steps
    folder = tmp_path / "sweep"
    driver = subprocess.Popen([sys.executable, "-m", "sweeps", "run", str(file), "--folder", str(folder),
                               "--executor", "slurm", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    name = "C1e11-small"
    wait_for(lambda: (folder / "runs" / name / "metrics.jsonl").exists(), what="the job to start training")
    job = job_id(registry_rows(folder)[name])
    proc = sweeps_cli("cancel", folder)
    assert proc.returncode == 0 and proc.stdout.strip() == f"{name}: cancelled (scancel {job})"
    assert driver.wait(timeout=180) == 1
    row = registry_rows(folder)[name]
    assert row["status"] == "cancelled"
    assert wait_for(lambda: sacct_states(job).get(job, "").startswith("CANCELLED"), what="sacct to say CANCELLED")
    assert f"cancelled {name}" in driver.stdout.read()


@pytest.mark.long
def test_a_driver_killed_mid_sweep_follows_its_jobs_when_restarted(cluster, tmp_path, write_sweep, registry_rows,
                                                                   completions):
    # two runs of about a hundred steps, one at a time (array_parallelism 1)
    extra = SLURM.replace('poll_s = 0.5', 'poll_s = 0.5\narray_parallelism = 1')
    file = write_sweep(tmp_path / "s.toml", budgets=[6e9], shapes=SHAPES, extra=extra)
    folder = tmp_path / "sweep"
    driver = subprocess.Popen([sys.executable, "-m", "sweeps", "run", str(file), "--folder", str(folder),
                               "--executor", "slurm", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def one_done_one_training():
        rows = registry_rows(folder) if (folder / "sweep.db").exists() else {}
        done = [r for r in rows.values() if r["status"] == "done"]
        training = [r for r in rows.values() if r["status"] == "running"
                    and (Path(r["run_dir"]) / "metrics.jsonl").exists()]
        return bool(done and training)

    wait_for(one_done_one_training, timeout=300, what="a finished run and one in training")
    before = registry_rows(folder)
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    jobs = {n: job_id(r) for n, r in before.items()}
    array = next(iter(jobs.values())).split("_")[0]
    assert any(s in ("RUNNING", "PENDING") for s in sacct_states(array).values())  # the jobs outlive the driver

    proc = run_sweep(file, folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = registry_rows(folder)
    for name, row in after.items():
        assert row["status"] == "done" and row["attempts"] == 1, name  # followed, not submitted again
        assert job_id(row) == jobs[name] and completions(folder, name) == 1
    assert set(sacct_states(array).values()) == {"COMPLETED"}


def test_a_submission_is_recorded_before_sbatch_so_a_stopped_driver_never_submits_a_run_twice(
        cluster, tmp_path, write_sweep, registry_rows, completions, monkeypatch):
    """Two runs with different resources (two submissions). Driver 1 dies right after sbatch accepted the
    first, before the job id was recorded; driver 2 dies after recording the second submission, before its
    sbatch; driver 3 finishes: each run is submitted once, runs once and counts one attempt."""
    import submitit.slurm.slurm as submitit_slurm

    from sweeps.cli import main
    from sweeps.driver import SUBMITTING, Recorder
    from sweeps.executors.slurm import job_name

    sweep_name = f"once-{os.getpid()}-{tmp_path.name}"
    shapes = [SHAPES[0], {**SHAPES[1], "launch": {"time_min": 7}}]
    file = write_sweep(tmp_path / "s.toml", name=sweep_name, budgets=[6e8], shapes=shapes, extra=SLURM)
    folder = tmp_path / "sweep"
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 120))
    monkeypatch.chdir(REPO)
    argv = ["run", str(file), "--folder", str(folder), "--executor", "slurm", "--no-progress"]

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # what the driver's SIGTERM handler raises; SIGKILL stops it at the same place

    with monkeypatch.context() as m:
        m.setattr(Recorder, "started", die)  # after the first sbatch returned
        assert main(argv) == 130
    first = {n: r for n, r in registry_rows(folder).items() if r["status"] == "running"}
    assert len(first) == 1 and next(iter(first.values()))["job"].startswith(SUBMITTING)
    with monkeypatch.context() as m:
        m.setattr(submitit_slurm.SlurmExecutor, "_internal_process_submissions", die)  # before the second sbatch
        assert main(argv) == 130
    rows = registry_rows(folder)
    assert [r["job"].startswith("slurm:") for r in rows.values()].count(True) == 1  # the first one found
    assert [r["job"].startswith(SUBMITTING) for r in rows.values()].count(True) == 1  # the second one recorded
    assert main(argv) == 0
    rows = registry_rows(folder)
    assert all(r["status"] == "done" and r["attempts"] == 1 for r in rows.values()), rows
    assert all(completions(folder, name) == 1 for name in rows)

    def submitted() -> list[str]:  # the accounting database records a job a moment after it ends
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-S", since, "-o", "JobID,JobName"], capture_output=True,
                             text=True, check=True).stdout.split()
        return sorted(line.split("|")[0] for line in out if line.split("|")[1].startswith(job_name(sweep_name)))

    recorded = sorted(job_id(r) for r in rows.values())
    wait_for(lambda: len(submitted()) >= len(recorded), timeout=60, what="sacct to list the sweep's jobs")
    assert submitted() == recorded  # one job per run, the one recorded


NASTY = "it's a \"run\"; touch PWNED-$(id -u) `touch PWNED2` && rm -rf nothing"


@pytest.mark.long
def test_names_with_spaces_quotes_and_semicolons_stay_inert_on_slurm(cluster, tmp_path, write_sweep, registry_rows):
    file = write_sweep(tmp_path / "s.toml", name="sweep 'one'; touch PWNED3", budgets=[6e8],
                       shapes=[{**SHAPES[0], "name": NASTY}], extra=SLURM)
    folder = tmp_path / "a folder; with 'quotes' \"and\" spaces"
    proc = run_sweep(file, folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = registry_rows(folder)[f"C6e8-{NASTY}"]
    assert row["status"] == "done" and Path(row["run_dir"]) == folder / "runs" / f"C6e8-{NASTY}"
    for place in (REPO, tmp_path, folder, folder / "runs"):
        assert not [p for p in place.iterdir() if p.name.startswith("PWNED")], place


def _script_attempt(tmp_path, write_sweep, launch: dict, name: str = NASTY, folder: str = "it's; here",
                    slurm: str = SLURM):
    """A planned attempt of one run with these launch settings, in a sweep folder with an awkward name."""
    from sweeps import runs as planner
    from sweeps import spec
    from sweeps.executors.attempt import Attempt

    file = write_sweep(tmp_path / f"{launch['strategy']}.toml", budgets=[6e8],
                       shapes=[{**SHAPES[0], "name": name, "launch": launch}], extra=slurm)
    sweep = spec.load(file, folder=tmp_path / folder)
    [run] = planner.plan(sweep).runs
    logs = sweep.folder / "logs" / run.name
    logs.mkdir(parents=True)
    return sweep, Attempt(run=run, run_dir=sweep.folder / "runs" / run.name, log=logs / "attempt-1.log",
                          lock=logs / "run.lock")


class _Events:
    def __init__(self):
        self.jobs: list[str] = []

    def start(self, attempt):
        return True

    def submitting(self, attempt, marker):
        pass

    def started(self, attempt, job):
        self.jobs.append(job)


@pytest.mark.long
def test_the_multi_node_script_runs_torchrun_with_c10d_rendezvous(cluster, tmp_path, write_sweep):
    """The path multi-node runs take (a script from launch/slurm.py, submitted with sbatch), run here on
    the one node with two processes; then a failing one, whose error line comes from the task logs."""
    from sweeps.executors.slurm import FINAL_STATES, SlurmExecutor

    sweep, attempt = _script_attempt(tmp_path, write_sweep, {"nproc": 2, "strategy": "ddp"})
    executor = SlurmExecutor(sweep.folder / "slurm", sweep.name, sweep.slurm, cwd=REPO)
    events = _Events()
    _, job = executor.submit_script(attempt, events)
    assert events.jobs == [job.job_id]
    state = wait_for(lambda: (s := sacct_states(job.job_id).get(job.job_id, "")) in FINAL_STATES and s,
                     what="the script job to end")
    task_logs = "".join(p.read_text() for p in attempt.run_dir.glob(f"logs/slurm-{job.job_id}-task*.out"))
    assert state == "COMPLETED" and "strategy ddp × 2" in task_logs, task_logs[-2000:]
    summary = json.loads((attempt.run_dir / "summary.json").read_text())
    assert (summary["status"], summary["strategy"], summary["world_size"]) == ("completed", "ddp", 2)
    assert executor._outcome(attempt, job, state).status == "done"
    script = attempt.log.with_suffix(".sbatch").read_text()
    assert "--rdzv_backend=c10d" in script and '--nnodes="$SLURM_NTASKS"' in script

    _, failing = _script_attempt(tmp_path, write_sweep, {"strategy": "no-such-strategy"}, name="bad",
                                 folder="second")
    _, job = executor.submit_script(failing, events)
    state = wait_for(lambda: (s := sacct_states(job.job_id).get(job.job_id, "")) in FINAL_STATES and s,
                     what="the failing script job to end")
    result = executor._outcome(failing, job, state)
    assert state == "FAILED" and result.status == "failed"
    assert result.error.startswith("error: unknown strategy 'no-such-strategy'")
    for place in (REPO, tmp_path, sweep.folder):
        assert not [p for p in place.iterdir() if p.name.startswith("PWNED")], place


def test_a_two_node_script_passes_every_value_through_unchanged(tmp_path, write_sweep):
    """No cluster needed: the script launch/slurm.py writes for a two-node run is run with stand-ins for
    scontrol and srun that record what they get."""
    from sweeps.executors.slurm import SLURM_PY, sbatch_options, script_command

    slurm = SLURM.replace("[launch]", 'qos = "normal"\nconstraint = "cpu&x86"\n[launch]')
    sweep, attempt = _script_attempt(tmp_path, write_sweep,
                                     {"nproc": 4, "nodes": 2, "strategy": "ddp", "gpus_per_proc": 1},
                                     folder="it's; $(touch PWNED4) here", slurm=slurm)
    script = attempt.log.with_suffix(".sbatch")
    command = script_command(attempt, sweep.slurm, "sweep-x", script)
    assert command[:2] == [sys.executable, str(SLURM_PY)]
    assert command[command.index("--") + 1:] == list(attempt.run.args)
    written = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    text = script.read_text()
    assert all(d in text for d in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --partition=debug",
                                   "#SBATCH --time=00:10:00", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=1024M",
                                   "#SBATCH --qos=normal", "#SBATCH --constraint=cpu&x86"))
    assert sbatch_options(attempt) == [f"--output={attempt.log}", "--open-mode=append"]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$ARGS_OUT"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2"}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "args").read_text().split("\0")[:-1]
    # a port free on the head node when the job starts (not one derived from the job id, which another job
    # on that node may hold)
    port = next(a for a in argv if a.startswith("--rdzv_endpoint=")).rpartition(":")[2]
    assert "import socket" in text and "SLURM_JOB_ID %" not in text and 1024 <= int(port) <= 65535
    assert {"--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d", "--rdzv_id=4242",
            f"--rdzv_endpoint=node-a:{port}"} <= set(argv)
    # the run's path and options arrive character for character
    assert argv[argv.index("launch/run.py"):] == ["launch/run.py", "--run-dir", str(attempt.run_dir), "--resume",
                                                  "auto", *attempt.run.args]
    # each task runs torchrun through bash -c: the first task (on the head node) hosts the store, by name
    argv = argv[argv.index("bash"):]
    assert argv[:2] == ["bash", "-c"] and argv[3] == sys.executable
    (bin_dir / "python").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$ARGS_OUT"\n')
    (bin_dir / "python").chmod(0o755)
    for task, host in (("0", "1"), ("1", "0")):
        subprocess.run([argv[0], argv[1], argv[2], str(bin_dir / "python"), *argv[4:]], check=True,
                       env={**env, "SLURM_PROCID": task})
        agent = (tmp_path / "args").read_text().split("\0")[:-1]
        assert agent[:3] == ["-m", "torch.distributed.run", f"--rdzv_conf=is_host={host}"]
        assert agent[3:] == argv[4:]
    assert NASTY in attempt.run_dir.name
    for place in (REPO, tmp_path, sweep.folder):
        assert not [p for p in place.iterdir() if p.name.startswith("PWNED")], place


def test_without_slurm_the_executor_is_refused_in_one_line_before_anything_is_recorded(tmp_path, write_sweep,
                                                                                      monkeypatch, capsys):
    """No cluster needed: a PATH that holds no sbatch, srun or sacct stands for a machine without SLURM."""
    from sweeps.cli import main
    from sweeps.registry import Registry

    file = write_sweep(tmp_path / "s.toml", budgets=[6e8], shapes=SHAPES[:1], extra=SLURM)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    folder = tmp_path / "sweep"
    assert main(["run", str(file), "--folder", str(folder), "--executor", "slurm", "--no-progress"]) == 2
    needs = "error: the slurm executor needs a SLURM cluster (sbatch, srun, sacct not found on PATH)"
    assert capsys.readouterr().err == needs + "\n"
    assert not folder.exists()  # nothing recorded, no folder made
    # a sweep that ran locally stays on the local executor
    Registry.open(folder, create=True).set_meta("executor", "local")
    before = (folder / "sweep.db").read_bytes()
    assert main(["run", str(file), "--folder", str(folder), "--executor", "slurm", "--no-progress"]) == 2
    assert capsys.readouterr().err == needs + "\n"
    assert (folder / "sweep.db").read_bytes() == before and Registry.open(folder).meta("executor") == "local"
    # one that last ran on slurm says how to run it here instead
    Registry.open(folder).set_meta("executor", "slurm")
    assert main(["run", str(file), "--folder", str(folder), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"{needs}; this sweep last ran on slurm: --executor local runs it here\n"
    assert Registry.open(folder).rows() == []
