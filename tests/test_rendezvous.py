"""Rendezvous not exposed by default (issue 32): local stores listen on 127.0.0.1 only; the multi-node
script's head node hosts the store by name, so a taken port fails instead of joining a stranger's store."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from lab.runtime.loopback import listen_on_loopback

ROOT = Path(__file__).resolve().parents[1]
rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package's attribute is a function


def _address(hex_address: str) -> str:
    """/proc/net/tcp's ``0100007F`` (IPv4, little-endian) or 32 hex digits (IPv6) as text."""
    import ipaddress

    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pids: set[int] | None = None) -> dict[int, set[str]]:
    """{port: addresses} of the TCP sockets listening on this machine (of ``pids`` alone when given)."""
    inodes = None
    if pids is not None:
        inodes = set()
        for pid in pids:
            try:
                links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:  # ended meanwhile
                continue
            inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or (inodes is not None and fields[9] not in inodes):  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            found.setdefault(int(port, 16), set()).add(_address(address))
    return found


@pytest.fixture
def loopback(monkeypatch):
    """listen_on_loopback() for one test: torch's TCPStore and GLOO_SOCKET_IFNAME are put back afterwards."""
    for module in (dist, c10d_backend, rendezvous):
        monkeypatch.setattr(module, "TCPStore", module.TCPStore)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    listen_on_loopback()


def test_torchs_own_store_listens_on_every_interface():
    """Why the lab binds the socket itself: the host given to TCPStore does not limit where it listens."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert listening()[store.port] & {"0.0.0.0", "::"}


def test_a_store_for_localhost_listens_on_127_0_0_1_only_and_answers_there(loopback):
    server = dist.TCPStore("localhost", 0, 2, True, timedelta(seconds=5), wait_for_workers=False)
    assert listening()[server.port] == {"127.0.0.1"}
    server.set("key", "value")
    client = dist.TCPStore("localhost", server.port, is_master=False, timeout=timedelta(seconds=5))
    assert client.get("key") == b"value"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"  # gloo's own sockets on the loopback interface too
    # the store for a named host (the head node of a multi-node job) is left to torch
    other = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert listening()[other.port] != {"127.0.0.1"}
    # a taken port fails, as before
    with pytest.raises(RuntimeError):
        dist.TCPStore("localhost", server.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_the_store_host_named_by_the_script_never_joins_a_strangers_store():
    """The multi-node script names task 0 the host (is_host=1, tested in tests/sweeps/test_sweeps_slurm.py): on
    a port some other job's store took, it fails; left to guess (torch's default), it joins that store."""
    stranger = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    stranger.set("secret", "theirs")

    def params(**conf: str) -> RendezvousParameters:
        return RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{stranger.port}", run_id="ours",
                                    min_nodes=1, max_nodes=2, read_timeout="5", **conf)

    with pytest.raises(RendezvousConnectionError):
        c10d_backend._create_tcp_store(params(is_host="1"))
    assert c10d_backend._create_tcp_store(params()).get("secret") == b"theirs"


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.long
@pytest.mark.slow  # starts a launcher and two ranks
def test_a_local_two_rank_run_listens_on_127_0_0_1_only(args, tmp_path):
    """``python -m lab train --nproc-per-node 2``, its ranks' own store too (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    as a restartable launch sets): every socket the launcher and ranks listen on, sampled while it runs."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen([sys.executable, "-m", "lab", "train", "--nproc-per-node", "2", "--strategy", "ddp",
                             *args, "--train.batch_tokens", "256", "--run-dir", str(tmp_path / "r")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, set[str]] = {}
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        for port, addresses in listening(_descendants(proc.pid)).items():
            seen.setdefault(port, set()).update(addresses)
        time.sleep(0.2)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert len(seen) >= 4, seen  # the rendezvous store, the ranks' store, each rank's gloo listener
    assert {a for addresses in seen.values() for a in addresses} == {"127.0.0.1"}, seen
