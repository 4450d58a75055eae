"""One run on several machines through SLURM: an sbatch script that starts torchrun on every node.

    python launch/slurm.py --nodes 4 --gpus-per-node 8 --partition gpu --time 08:00:00 \\
        --job-name big-run --run-dir /shared/runs/big-run --submit -- --config configs/x.toml --strategy zero2

The script asks SLURM for ``nodes`` × ``tasks_per_node`` tasks (one per node normally); ``srun``
starts one torchrun agent per task, and the agents meet by c10d rendezvous on the first node of
the allocation (``--nnodes`` is the number of tasks, so one node with two tasks stands in for two
nodes in a test). The rendezvous port is one free on that node when the job starts (or ``--port``),
and its first task is the store's host by name (``is_host``): a port taken meanwhile fails the job
instead of joining whatever store listens there. torchrun restarts a failed group up to
``max_restarts`` times and the run resumes from its newest complete checkpoint (``--resume auto``),
which also covers a job that SLURM requeues after a preemption. The run directory must be on a
filesystem every node sees (checkpoints are written by every rank into it); each node prepares its
own copy of the data.

Every value that reaches the shell is quoted; values that reach ``#SBATCH`` lines are reduced to
characters SLURM reads the same way on every version (a job name) or refused (a partition, account,
QOS, constraint or memory size with other characters).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lab.runtime.config import SLURM_PLAIN, SLURM_SETTINGS, ConfigError, Parser
from lab.runtime.files import probe_writable, write_atomic

ROOT = Path(__file__).resolve().parents[2]
_MEMORY = re.compile(r"[0-9]+[KMGT]?")  # sbatch --mem: megabytes, or with a unit
FREE_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


@dataclass(frozen=True)
class MultiNode:
    """What one multi-node run asks of SLURM and of torchrun."""

    run_dir: Path
    run_args: list[str] = field(default_factory=list)  # launch/run.py's options (config, strategy, overrides)
    nodes: int = 2
    tasks_per_node: int = 1
    procs_per_task: int = 1  # torchrun's --nproc_per_node: the GPUs of a node
    gpus_per_node: int = 0
    cpus_per_task: int = 8
    job_name: str = "lab-run"
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None  # node features, e.g. h100 or "h100&ib"
    mem: str | None = None  # per node, as sbatch reads it: 64G, 500000 (MB); 0 is all of it
    max_restarts: int = 1
    port: int | None = None  # rendezvous port on the first node (default: one free there when the job starts)
    python: str = sys.executable

    def validate(self) -> None:
        for name in ("nodes", "tasks_per_node", "procs_per_task", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.gpus_per_node < 0 or self.max_restarts < 0:
            raise ConfigError("--gpus-per-node and --max-restarts must be >= 0")
        if self.port is not None and not 1024 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 1024..65535, got {self.port}")
        for name, allowed in (("time", SLURM_PLAIN), *SLURM_SETTINGS.items()):
            value = getattr(self, name)
            if value is not None and not allowed.fullmatch(value):
                raise ConfigError(f"--{name} {value!r} holds characters SLURM would not read as written")
        if self.mem is not None and not _MEMORY.fullmatch(self.mem):
            raise ConfigError(f"--mem {self.mem!r} is not a memory size sbatch reads (e.g. 64G, 512000 for MB)")
        if "--run-dir" in self.run_args or any(a.startswith("--run-dir=") for a in self.run_args):
            raise ConfigError("give the run directory with --run-dir before '--', not among the run's options")


def sbatch_script(job: MultiNode) -> str:
    """The batch script's text (see the module docstring)."""
    q = shlex.quote
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", job.job_name)[:64] or "lab-run"
    directives = [f"--job-name={name}", f"--nodes={job.nodes}", f"--ntasks-per-node={job.tasks_per_node}",
                  f"--cpus-per-task={job.cpus_per_task}", f"--time={job.time}"]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    directives += [f"--{key}={getattr(job, key)}" for key in ("partition", "account", "qos", "constraint", "mem")
                   if getattr(job, key)]
    # the batch script runs on the head node: a port free there now, unless one is given
    free_port = f"$({q(job.python)} -c {q(FREE_PORT)})"
    # task 0 (on the head node) hosts the store and fails on a taken port; the others only connect to it
    agent = 'exec "$0" -m torch.distributed.run --rdzv_conf="is_host=$((SLURM_PROCID == 0))" "$@"'
    torchrun = ["bash", "-c", q(agent), q(job.python), '--nnodes="$SLURM_NTASKS"',
                f"--nproc_per_node={job.procs_per_task}", "--rdzv_backend=c10d", '--rdzv_id="$SLURM_JOB_ID"',
                '--rdzv_endpoint="$head:$port"',
                f"--max-restarts={job.max_restarts}", "launch/run.py", '--run-dir "$run_dir"', "--resume auto",
                *map(q, job.run_args)]
    return "\n".join([
        "#!/bin/bash",
        f"# One run on {job.nodes} node(s), written by launch/slurm.py. Submit with: sbatch THIS_FILE",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        f"cd {q(str(ROOT))}",
        f"run_dir={q(str(job.run_dir))}",
        f"logs={q(str(job.run_dir / 'logs').replace('%', '%%'))}  # srun reads % in a file name as a pattern",
        'mkdir -p "$run_dir/logs"',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port={job.port or free_port}",
        "",
        "# Settings clusters commonly need; adjust to yours:",
        "# export NCCL_SOCKET_IFNAME=ib0          # the network interface between nodes (see `ip addr`)",
        "# export GLOO_SOCKET_IFNAME=ib0          # the same for gloo (CPU runs)",
        "# export NCCL_IB_DISABLE=1               # when InfiniBand is absent or broken",
        "# export NCCL_DEBUG=WARN                 # INFO to see how NCCL connects",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed NCCL collective ends the job instead of hanging",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # restarted groups reconnect (pytorch/pytorch#135712)",
        f"export OMP_NUM_THREADS={max(1, job.cpus_per_task // job.procs_per_task)} PYTHONUNBUFFERED=1",
        "",
        'srun --kill-on-bad-exit=1 --output="$logs/slurm-%j-task%t.out" ' + " ".join(torchrun),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="launch/slurm.py", description="Write (and submit) an sbatch script for one multi-node run. "
                                                   "Options after '--' go to launch/run.py.")
    p.formatter_class = argparse.HelpFormatter  # each help below states its own default, once
    p.add_argument("--run-dir", required=True, help="the run directory, on a filesystem every node sees")
    p.add_argument("--nodes", type=int, default=2, help="nodes (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node; torchrun starts one process each (default: %(default)s)")
    p.add_argument("--procs-per-node", type=int, help="processes per node (default: the GPUs per node, or 1)")
    p.add_argument("--tasks-per-node", type=int, default=1, help=argparse.SUPPRESS)  # 2 on one node stands in for 2
    p.add_argument("--cpus-per-task", type=int, default=8, help="CPUs per node's task (default: %(default)s)")
    p.add_argument("--mem", help="memory per node as sbatch reads it: 64G, 512000 (MB); 0 is all of it "
                                 "(default: the cluster's)")
    p.add_argument("--job-name", default="lab-run", help="the name SLURM shows (default: %(default)s)")
    p.add_argument("--time", default="01:00:00", help="SLURM time limit (default: %(default)s)")
    p.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    p.add_argument("--account", help="account charged (default: the user's)")
    p.add_argument("--qos", help="quality of service (default: the cluster's)")
    p.add_argument("--constraint", help="node features, e.g. h100 or 'h100&ib' (default: any node)")
    p.add_argument("--max-restarts", type=int, default=1,
                   help="torchrun restarts of a failed group (default: %(default)s)")
    p.add_argument("--port", type=int, help="rendezvous port on the first node (default: one free there when the job "
                                            "starts)")
    p.add_argument("--out", help="where to write the script (default: RUN_DIR/run.sbatch)")
    p.add_argument("--submit", action="store_true", help="submit it with sbatch")
    own, rest = list(argv if argv is not None else sys.argv[1:]), []
    if "--" in own:
        own, rest = own[:own.index("--")], own[own.index("--") + 1:]
    args = p.parse_args(own)
    job = MultiNode(run_dir=Path(args.run_dir).absolute(), run_args=rest, nodes=args.nodes,
                    tasks_per_node=args.tasks_per_node,
                    procs_per_task=args.procs_per_node or max(1, args.gpus_per_node),
                    gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, job_name=args.job_name,
                    time=args.time, partition=args.partition, account=args.account, qos=args.qos,
                    constraint=args.constraint, mem=args.mem, max_restarts=args.max_restarts, port=args.port)
    out = Path(args.out) if args.out else job.run_dir / "run.sbatch"
    try:
        job.validate()
        probe_writable(out.parent, "--out")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, sbatch_script(job))
    print(f"wrote {out}")
    if args.submit:
        # submitted from the script's folder, so sbatch's own output (slurm-JOBID.out) lands beside it
        proc = subprocess.run(["sbatch", "--parsable", out.name], capture_output=True, text=True, cwd=out.parent)
        if proc.returncode:
            print(f"error: sbatch failed: {' '.join(proc.stderr.split())[:300]}", file=sys.stderr)
            return 1
        print(f"submitted job {proc.stdout.strip()}")
    return 0
