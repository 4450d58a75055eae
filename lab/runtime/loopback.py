"""Ranks on one machine that no other machine can reach: torchrun ``--standalone`` with its stores on 127.0.0.1.

torch's TCPStore server listens on every interface whatever host it is given, so a ``--standalone``
launch (its rendezvous store and the workers' store) would answer anyone on the network who finds the
port. :func:`listen_on_loopback` makes every store server this process starts for a loopback host bind
127.0.0.1 alone (a socket bound here and handed over as ``master_listen_fd``); gloo's own sockets go to
the loopback interface. ``python -m lab.runtime.loopback ARGS`` is ``torchrun ARGS`` with both.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from typing import Any

from lab.runtime.processes import AGENT_PID

LOOPBACK_HOSTS = ("localhost", "127.0.0.1")
_STORE_OPTIONS = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd",
                  "use_libuv")


def listen_on_loopback() -> None:
    """From now on a TCPStore server for ``localhost``/``127.0.0.1`` listens on 127.0.0.1 only (a taken port
    fails as before); gloo uses the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise."""
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package's attribute is a function

    if getattr(dist.TCPStore, "loopback", False):
        return
    tcp_store = dist.TCPStore
    sockets: list[socket.socket] = []  # kept open for the life of the process, as the stores use them

    def loopback_store(host_name: str, port: int, *args: Any, **kwargs: Any) -> Any:
        kwargs.update(zip(_STORE_OPTIONS, args))
        if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None and host_name in LOOPBACK_HOSTS:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind(("127.0.0.1", port))
            except OSError as e:  # raised as torch's own store would, for the callers that catch it
                listener.close()
                raise dist.DistNetworkError(f"the store cannot listen on 127.0.0.1:{port}: {e.strerror}") from None
            listener.listen(4096)
            sockets.append(listener)
            port, kwargs["master_listen_fd"] = listener.getsockname()[1], listener.fileno()
        return tcp_store(host_name, port, **kwargs)

    loopback_store.loopback = True  # type: ignore[attr-defined]
    dist.TCPStore = c10d_backend.TCPStore = rendezvous.TCPStore = loopback_store  # every place torch makes one
    if sys.platform == "linux" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def main() -> None:
    """``torchrun`` (``python -m torch.distributed.run``) with the stores on 127.0.0.1; for ``--standalone``. Its
    ranks die with it (``lab.runtime.processes``)."""
    listen_on_loopback()
    os.environ[AGENT_PID] = str(os.getpid())
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
