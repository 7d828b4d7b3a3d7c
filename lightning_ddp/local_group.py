"""Ranks on one host (the benchmarks, the multi-process tests): a free port to meet at, and joining their process
group over loopback (``GLOO_SOCKET_IFNAME=lo`` on Linux) with each rank's share of the cores. Imports no torch.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta


def find_free_port() -> int:
    """A localhost TCP port that was free a moment ago (the OS picks it when binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_local_process_group(
    rank: int,
    world_size: int,
    port: int,
    backend: str = "gloo",
    *,
    threads: int | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> None:
    """Join the process group of ``world_size`` ranks on this host that meet at ``tcp://127.0.0.1:port``, with
    ``threads`` intra-op threads (None: as they are); ``backend`` may be per device (``cpu:gloo,cuda:nccl``)."""
    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: avoid an interface that does not route back
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timeout)

