"""The SLURM executor: single-node runs through submitit (one job array per set of resources),
multi-node runs as sbatch scripts that start torchrun on every node with c10d rendezvous.

Jobs live on the cluster, not in the driver: a driver that stops (Ctrl-C, SIGKILL) leaves them
running, and the next ``run`` follows them again by their job ids from the registry. States come
from ``sacct`` (through submitit's watcher), so the cluster needs accounting (slurmdbd) for failed
and cancelled jobs to be seen.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from sweeps.executors.attempt import (Attempt, Events, ExecutorError, Outcome, outcome, run_options,
                                     torchrun_command)
from sweeps.executors.job import run_attempt
from sweeps.spec import Launch

# sacct states after which a job will not run again (PREEMPTED is not one: SLURM may requeue it).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                "DEADLINE", "REVOKED"}


class SlurmError(ExecutorError):
    """Submission failed; the message is one line."""


def job_name(sweep_name: str) -> str:
    """A job name SLURM tools show as is: the sweep's name with anything unusual replaced."""
    return "sweep-" + re.sub(r"[^A-Za-z0-9_.-]", "_", sweep_name)[:60]


def sbatch_script(attempt: Attempt, threads: int) -> str:
    """A batch script for a multi-node run: under the run's lock, srun starts one torchrun per node,
    which meet by c10d rendezvous on the first node. Every value from the sweep is quoted."""
    q = shlex.quote
    launch = attempt.run.launch
    return "\n".join([
        "#!/bin/bash",
        "# A sweep run on several nodes, written by the sweep driver (sweeps/executors/slurm.py).",
        "set -euo pipefail",
        f"exec 9>>{q(str(attempt.lock))}",
        "flock 9  # one live attempt per run",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        f"export OMP_NUM_THREADS={threads} PYTHONUNBUFFERED=1",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {q(sys.executable)} -m torch.distributed.run "
        f'--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node={launch.nproc} --rdzv_backend=c10d '
        '--rdzv_id="$SLURM_JOB_ID" --rdzv_endpoint="$head:$port" ' + " ".join(map(q, run_options(attempt))),
        "",
    ])


def sbatch_options(attempt: Attempt, settings: dict[str, Any], name: str, cwd: Path) -> list[str]:
    """sbatch's command-line options for a script run (arguments, so no shell parses them)."""
    launch = attempt.run.launch
    options = [f"--job-name={name}", f"--nodes={launch.nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={launch.nproc * launch.cpus_per_proc}", f"--mem={int(launch.mem_gb * 1024)}M",
               f"--time={launch.time_min}", f"--output={attempt.log}", "--open-mode=append", f"--chdir={cwd}"]
    if launch.gpus_per_proc:
        options.append(f"--gpus-per-node={launch.nproc * launch.gpus_per_proc}")
    return options + [f"--{key}={settings[key]}" for key in ("partition", "account", "qos", "constraint")
                      if key in settings]


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
        import submitit  # the 'slurm' extra

        self.submitit = submitit
        self.folder, self.settings, self.cwd = folder, settings, cwd
        self.job_name = job_name(sweep_name)
        self.poll_s = float(settings.get("poll_s", 5.0))

    # ------------------------------------------------------------ submission

    def _submit_array(self, attempts: list[Attempt], events: Events) -> list[tuple[Attempt, Any]]:
        """One submitit batch (a SLURM array when it holds several runs) for attempts with equal resources."""
        executor = self.submitit.SlurmExecutor(folder=self.folder)
        executor.update_parameters(**array_parameters(attempts[0].run.launch, self.settings, self.job_name))
        chosen = [a for a in attempts if events.start(a)]
        if not chosen:
            return []
        jobs = []
        try:
            with executor.batch():
                for a in chosen:
                    threads = a.run.launch.cpus_per_proc
                    jobs.append(executor.submit(run_attempt, torchrun_command(a), threads, str(self.cwd),
                                                str(a.log), str(a.lock)))
        except Exception as e:  # submitit raises plain exceptions carrying sbatch's message
            raise SlurmError(f"sbatch failed: {' '.join(str(e).split())[:300]}") from None
        for a, job in zip(chosen, jobs):
            events.started(a, job.job_id)
        return list(zip(chosen, jobs))

    def submit_script(self, attempt: Attempt, events: Events) -> tuple[Attempt, Any] | None:
        """Write the attempt's batch script next to its log and submit it with sbatch."""
        if not events.start(attempt):
            return None
        launch = attempt.run.launch
        script = attempt.log.with_suffix(".sbatch")
        tmp = script.with_name(f".{script.name}.tmp")
        tmp.write_text(sbatch_script(attempt, launch.cpus_per_proc))
        tmp.replace(script)
        options = sbatch_options(attempt, self.settings, self.job_name, self.cwd)
        proc = subprocess.run(["sbatch", "--parsable", *options, str(script)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SlurmError(f"sbatch failed: {' '.join(proc.stderr.split())[:300]}")
        job_id = proc.stdout.strip().split(";")[0]
        events.started(attempt, job_id)
        return attempt, self.submitit.SlurmJob(folder=self.folder, job_id=job_id)

    # ------------------------------------------------------------ the loop

    def run(self, attempts: list[Attempt], events: Events) -> None:
        """Submit new attempts, follow earlier drivers' jobs, and report each as it ends."""
        watched = [(a, self.submitit.SlurmJob(folder=self.folder, job_id=a.job)) for a in attempts if a.job]
        groups: dict[Launch, list[Attempt]] = defaultdict(list)
        for a in attempts:
            if a.job:
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
        except KeyboardInterrupt:
            print(f"{len(watched)} job(s) keep running on the cluster: run the sweep again to follow them, "
                  f"or cancel them", file=sys.stderr)
            raise

    @staticmethod
    def _outcome(attempt: Attempt, job: Any, state: str) -> Outcome:
        if state == "CANCELLED":
            return Outcome("cancelled", error=f"SLURM job {job.job_id} cancelled")
        return outcome(attempt, f"SLURM job {job.job_id} ended {state}")


def cancel(folder: Path, job_id: str) -> None:
    """scancel a job (through submitit)."""
    import submitit

    submitit.SlurmJob(folder=folder, job_id=job_id).cancel(check=False)
