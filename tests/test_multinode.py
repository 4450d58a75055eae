"""One run across several machines: two torchrun agents meeting by c10d rendezvous against plain python, and the
SLURM launcher.

The two agents run on this host (127.0.0.1 only), each standing in for a node with one process;
each prepares its own copy of the data, as nodes without a shared data disk would.
"""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.commands.ranks import free_port
from lab.commands.slurm import MultiNode, main, sbatch_script

pytestmark = pytest.mark.slow  # launches processes or trains many runs: `make test` only, not test-fast

ROOT = Path(__file__).resolve().parents[1]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def two_nodes(argv: list[str], run_dir: Path) -> list[subprocess.CompletedProcess]:
    """Start two torchrun agents that meet on a free localhost port, like two nodes of one job."""
    port = free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=test-{port}",
                                "launch/run.py", *argv, "--run-dir", str(run_dir)], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}) for _ in range(2)]
    return [subprocess.CompletedProcess(a.args, a.wait(timeout=300), *a.communicate()) for a in agents]


@pytest.fixture(scope="module")
def multinode_runs(args, tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    # the reference: the README's plain-python command, one process
    plain = subprocess.run([sys.executable, "launch/run.py", *args, "--run-dir", str(root / "single")], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "step     8/8 | loss" in plain.stdout and "held-out loss" in plain.stdout
    # one sharded strategy across the two agents (ddp crosses two agents in the SLURM test below)
    argv = [*args, "--strategy", "zero2", "--data.cache_dir", str(root / "cache")]  # not yet prepared: each "node" does
    for agent in two_nodes(argv, root / "zero2"):
        assert agent.returncode == 0, agent.stderr[-3000:]
    return {"single": root / "single", "zero2": root / "zero2"}


@pytest.mark.long
def test_two_nodes_train_the_single_process_model(multinode_runs):
    single, got = losses(multinode_runs["single"]), losses(multinode_runs["zero2"])
    assert len(got) == len(single) == 8
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(single, got))
    summary = json.loads((multinode_runs["zero2"] / "summary.json").read_text())
    assert (summary["world_size"], summary["strategy"], summary["status"]) == (2, "zero2", "completed")


# ---------------------------------------------------------------- the SLURM script

NASTY = "it's a \"run\"; rm -rf ~ $(whoami) %j"


def test_the_sbatch_script_quotes_every_value(tmp_path):
    run_dir = tmp_path / NASTY
    script = sbatch_script(MultiNode(run_dir=run_dir, run_args=["--config", "my config.toml", "--strategy", "zero2"],
                                     nodes=4, procs_per_task=8, gpus_per_node=8, job_name=NASTY, partition="gpu",
                                     max_restarts=2))
    lines = script.splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=it_s_a__run___rm_-rf_____whoami___j", "#SBATCH --nodes=4",
                          "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=8", "#SBATCH --time=01:00:00",
                          "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu"]
    assert f"run_dir={shlex.quote(str(run_dir))}" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    words = shlex.split(srun)  # what the shell would pass, before expanding the $ variables
    assert words[words.index("--run-dir") + 1] == "$run_dir" and "'my config.toml'" in srun
    assert "--nnodes=$SLURM_NTASKS" in words and "--rdzv_backend=c10d" in words and "--max-restarts=2" in words
    assert "--rdzv_endpoint=$head:$port" in words and words[words.index("--resume") + 1] == "auto"
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script and "NCCL_SOCKET_IFNAME" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.long
def test_the_sbatch_script_trains_on_the_local_cluster(cluster, multinode_runs, args, tmp_path, capsys):
    """The generated script, submitted to the localhost cluster: one node with two tasks stands in for two
    nodes (two torchrun agents, c10d rendezvous); a name full of shell syntax stays a name."""
    run_dir = tmp_path / f"$(touch PWNED) {NASTY}"
    assert main(["--run-dir", str(run_dir), "--nodes", "1", "--tasks-per-node", "2", "--cpus-per-task", "1",
                 "--job-name", NASTY, "--time", "00:10:00", "--submit", "--", *args, "--strategy", "ddp"]) == 0
    job = capsys.readouterr().out.split("submitted job ")[1].strip()
    deadline, state = time.monotonic() + 300, ""
    while time.monotonic() < deadline and state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        time.sleep(1)
        state = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job], capture_output=True,
                               text=True).stdout.strip()
    task_logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob(f"slurm-{job}-task*.out")))
    assert state == "COMPLETED", (state, task_logs[-3000:], (run_dir / f"slurm-{job}.out").read_text()[-2000:])
    assert len(list((run_dir / "logs").glob(f"slurm-{job}-task*.out"))) == 2  # two tasks: two "nodes"
    single, got = losses(multinode_runs["single"]), losses(run_dir)
    assert len(got) == len(single) == 8 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(single, got))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["world_size"], summary["strategy"]) == ("completed", 2, "ddp")
    for place in (ROOT, tmp_path, run_dir):
        assert not [p for p in place.iterdir() if p.name.startswith("PWNED")], place


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "0"], "--nodes must be positive"),
    (["--partition", "gpu;rm"], "--partition 'gpu;rm' holds characters SLURM would not read as written"),
    (["--port", "80"], "--port must be in 1024..65535"),
    (["--mem", "64 GB"], "--mem '64 GB' is not a memory size sbatch reads"),
    (["--constraint", "h100 ib"], "--constraint 'h100 ib' holds characters SLURM would not read as written"),
    (["--qos", "hi;gh"], "--qos 'hi;gh' holds characters SLURM would not read as written"),
    (["--", "--run-dir", "elsewhere"], "give the run directory with --run-dir before '--'"),
])
def test_the_launcher_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    own, sep, rest = (argv[:argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [], [])
    assert main(["--run-dir", str(tmp_path / "r"), *own, *sep, *rest]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "r").exists()


def test_the_launcher_asks_for_qos_constraint_and_memory_and_states_each_default_once(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["--run-dir", str(tmp_path / "r"), "--qos", "high", "--constraint", "h100&ib", "--mem", "500G",
                 "--out", str(out)]) == 0
    directives = [line for line in out.read_text().splitlines() if line.startswith("#SBATCH")]
    assert directives[-3:] == ["#SBATCH --qos=high", "#SBATCH --constraint=h100&ib", "#SBATCH --mem=500G"]
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and ") (default:" not in text
    for option, default in (("--nodes", "2"), ("--cpus-per-task", "8"), ("--time", "01:00:00"),
                            ("--max-restarts", "1"), ("--procs-per-node", "the GPUs per node, or 1")):
        after = text.split(f" {option} ", 1)[1]
        assert after.split(" --", 1)[0].endswith(f"(default: {default})"), option
