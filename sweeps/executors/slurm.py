"""The SLURM executor: single-node runs through submitit (one job array per set of resources),
multi-node runs as sbatch scripts written by the lab's ``launch/slurm.py`` (torchrun on every node,
c10d rendezvous on the first), reached through its command line like every run.

Jobs live on the cluster, not in the driver: a driver that stops (Ctrl-C, SIGKILL) leaves them
running, and the next ``run`` follows them again by their job ids from the registry. Each submission
gets a job name of its own, recorded with the attempt before ``sbatch`` runs; a driver stopped between
the two leaves a row with that name and no job id, and the next ``run`` asks SLURM (``squeue``,
``sacct --name``) for it: found, it is followed; not found, it was never submitted and is submitted now. States come
from ``sacct`` (through submitit's watcher), so the cluster needs accounting (slurmdbd) for failed
and cancelled jobs to be seen.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from lab.runtime import chaos

from sweeps.executors.attempt import REPO, Attempt, Events, ExecutorError, Outcome, outcome, run_command
from sweeps.executors.job import run_attempt
from sweeps.sweep import Launch

SLURM_PY = REPO / "launch" / "slurm.py"
SLURM_TOOLS = ("sbatch", "srun", "sacct")  # submit, start tasks (submitit checks it), follow jobs
# sacct states after which a job will not run again (PREEMPTED is not one: SLURM may requeue it).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                "DEADLINE", "REVOKED"}


class SlurmError(ExecutorError):
    """Submission failed; the message is one line."""


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def job_name(sweep_name: str) -> str:
    """A job name SLURM tools show as is: the sweep's name with anything unusual replaced."""
    return "sweep-" + re.sub(r"[^A-Za-z0-9_.-]", "_", sweep_name)[:60]


def submission_marker(name: str, index: int | None, at: float) -> str:
    """What the registry records before a submission: the job's unique name, its task in the array (None: not an
    array) and when (sacct searches from a day before)."""
    return f"{name}#{'' if index is None else index}@{int(at)}"


def find_submitted(marker: str) -> str | None:
    """The job id (``ID`` or ``ID_TASK``) a recorded submission got on the cluster, None if SLURM never saw it."""
    name, _, rest = marker.rpartition("#")
    index, _, at = rest.partition("@")
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(at) - 86400))
    ids = set()
    for command in (["squeue", "--noheader", "--states=all", "--name", name, "--format=%F"],
                    ["sacct", "-X", "-n", "-P", "--name", name, "-S", since, "-o", "JobID"]):
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SlurmError(f"{command[0]} failed while looking for job {name}: {_one_line(proc.stderr)}")
        ids |= {line.split("_")[0] for line in proc.stdout.split()}
    if not ids:
        return None
    main = min(ids, key=int)  # one submission per name: several ids would mean SLURM requeued it under a new one
    return f"{main}_{index}" if index else main


def script_command(attempt: Attempt, settings: dict[str, Any], name: str, script: Path) -> list[str]:
    """``launch/slurm.py``'s command line that writes a multi-node attempt's batch script to ``script``."""
    launch = attempt.run.launch
    hours, minutes = divmod(launch.time_min, 60)
    command = [sys.executable, str(SLURM_PY), "--run-dir", str(attempt.run_dir), "--nodes", str(launch.nodes),
               "--gpus-per-node", str(launch.nproc * launch.gpus_per_proc), "--procs-per-node", str(launch.nproc),
               "--cpus-per-task", str(launch.nproc * launch.cpus_per_proc), "--job-name", name,
               "--time", f"{hours:02d}:{minutes:02d}:00", "--mem", f"{int(launch.mem_gb * 1024)}M",
               "--out", str(script)]
    for key in ("partition", "account", "qos", "constraint"):
        if key in settings:
            command += [f"--{key}", settings[key]]
    return command + ["--", *attempt.run.args]


def sbatch_options(attempt: Attempt) -> list[str]:
    """What sbatch adds to the script's own #SBATCH lines (arguments, so no shell parses them; a '%' in the log's
    path, from a run's or the sweep's name, doubled so that SLURM does not read it as a pattern)."""
    return [f"--output={str(attempt.log).replace('%', '%%')}", "--open-mode=append"]  # % starts a pattern


def array_parameters(launch: Launch, settings: dict[str, Any], name: str) -> dict[str, Any]:
    """submitit's parameters for a single-node run: what SLURM allocates it, from its launch settings."""
    parameters: dict[str, Any] = {
        "job_name": name, "time": launch.time_min, "nodes": 1, "ntasks_per_node": 1,
        "cpus_per_task": launch.nproc * launch.cpus_per_proc, "mem": f"{int(launch.mem_gb * 1024)}M",
        "array_parallelism": int(settings.get("array_parallelism", 256)),
    }
    if launch.gpus_per_proc:
        parameters["gpus_per_node"] = launch.nproc * launch.gpus_per_proc
    return parameters | {key: settings[key] for key in ("partition", "account", "qos", "constraint", "setup")
                         if key in settings}


class SlurmExecutor:
    """Submits to the cluster's ``partition`` (and ``account``, ``qos``, ``constraint``) from ``[slurm]``."""

    name = "slurm"

    def __init__(self, folder: Path, sweep_name: str, settings: dict[str, Any], cwd: Path):
        """RuntimeError if SLURM's tools are not on PATH (before anything is submitted or recorded)."""
        import submitit  # the 'slurm' extra

        missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not found on PATH")
        self.submitit = submitit
        self.folder, self.settings, self.cwd = folder, settings, cwd
        self.job_name = job_name(sweep_name)  # each submission's name adds a token of its own
        self.poll_s = float(settings.get("poll_s", 5.0))

    # ------------------------------------------------------------ submission

    def _submit_array(self, attempts: list[Attempt], events: Events) -> list[tuple[Attempt, Any]]:
        """One submitit batch (a SLURM array when it holds several runs) for attempts with equal resources."""
        chosen = [a for a in attempts if events.start(a)]
        if not chosen:
            return []
        name, at = self._submission_name(), time.time()
        for index, a in enumerate(chosen):  # submitit makes an array of several, a plain job of one
            events.submitting(a, submission_marker(name, index if len(chosen) > 1 else None, at))
        chaos.point("submit-record")
        executor = self.submitit.SlurmExecutor(folder=self.folder)
        executor.update_parameters(**array_parameters(attempts[0].run.launch, self.settings, name))
        jobs = []
        try:
            with executor.batch():
                for a in chosen:
                    threads = a.run.launch.cpus_per_proc
                    jobs.append(executor.submit(run_attempt, run_command(a), threads, str(self.cwd),
                                                str(a.log), str(a.lock), a.number))
        except Exception as e:  # submitit raises plain exceptions carrying sbatch's message
            raise SlurmError(f"sbatch failed: {_one_line(str(e))}") from None
        for a, job in zip(chosen, jobs):
            events.started(a, job.job_id)
        return list(zip(chosen, jobs))

    def submit_script(self, attempt: Attempt, events: Events) -> tuple[Attempt, Any] | None:
        """Have ``launch/slurm.py`` write the attempt's batch script next to its log, and submit it."""
        if not events.start(attempt):
            return None
        script = attempt.log.with_suffix(".sbatch")
        name = self._submission_name()
        events.submitting(attempt, submission_marker(name, None, time.time()))
        chaos.point("submit-record")
        written = subprocess.run(script_command(attempt, self.settings, name, script), capture_output=True,
                                 text=True, cwd=self.cwd)
        if written.returncode != 0:
            raise SlurmError(f"launch/slurm.py failed: {_one_line(written.stderr)}")
        proc = subprocess.run(["sbatch", "--parsable", *sbatch_options(attempt), str(script)],
                              capture_output=True, text=True, cwd=self.cwd)
        if proc.returncode != 0:
            raise SlurmError(f"sbatch failed: {_one_line(proc.stderr)}")
        job_id = proc.stdout.strip().split(";")[0]
        events.started(attempt, job_id)
        return attempt, self.submitit.SlurmJob(folder=self.folder, job_id=job_id)

    def _submission_name(self) -> str:
        return f"{self.job_name}-{secrets.token_hex(4)}"

    # ------------------------------------------------------------ the loop

    def run(self, attempts: list[Attempt], events: Events) -> None:
        """Submit new attempts, follow earlier drivers' jobs, and report each as it ends."""
        watched = [(a, self.submitit.SlurmJob(folder=self.folder, job_id=a.job)) for a in attempts if a.job]
        groups: dict[Launch, list[Attempt]] = defaultdict(list)
        for a in attempts:
            if a.job:
                continue
            found = find_submitted(a.submitting) if a.submitting else None
            if found:  # submitted by a driver that stopped before it recorded the job id
                events.started(a, found)
                watched.append((a, self.submitit.SlurmJob(folder=self.folder, job_id=found)))
                continue
            if a.run.launch.nodes > 1:
                submitted = self.submit_script(a, events)
                watched += [submitted] if submitted else []
            else:
                groups[a.run.launch].append(a)  # one array per launch setting (the resources it asks for)
        for group in groups.values():
            watched += self._submit_array(group, events)
        try:
            while watched:
                time.sleep(self.poll_s)
                self.submitit.SlurmJob.watcher.update()
                still = []
                for attempt, job in watched:
                    state = job.watcher.get_state(job.job_id, mode="cache").split()[0]
                    if state in FINAL_STATES:
                        events.finished(attempt, self._outcome(attempt, job, state))
                    else:
                        still.append((attempt, job))
                watched = still
                events.tick()
        except KeyboardInterrupt:
            print(f"{len(watched)} job(s) keep running on the cluster: run the sweep again to follow them, "
                  f"or cancel them", file=sys.stderr)
            raise

    @staticmethod
    def _outcome(attempt: Attempt, job: Any, state: str) -> Outcome:
        if state == "CANCELLED":
            return Outcome("cancelled", error=f"SLURM job {job.job_id} cancelled")
        # a multi-node run's processes write to launch/slurm.py's per-task logs in the run directory
        task_logs = sorted(attempt.run_dir.glob(f"logs/slurm-{job.job_id}-task*.out"))
        return outcome(attempt, f"SLURM job {job.job_id} ended {state}", task_logs)


def cancel(folder: Path, job_id: str) -> None:
    """scancel a job (through submitit)."""
    import submitit

    submitit.SlurmJob(folder=folder, job_id=job_id).cancel(check=False)
