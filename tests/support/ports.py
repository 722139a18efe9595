"""Free loopback ports for tests that hand a port to another process.

A port that bind(("127.0.0.1", 0)) found is free only until the probe closes. It comes from
the kernel's ephemeral range, where every connect() and bind(0) on the machine (other
tests' ranks and stores, Ray, Jupyter) is handed its port: one of those may take it before
the process the test started binds it. A port below that range is never handed out so.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that is free now and outside the ephemeral range.

    Each pytest-xdist worker draws from a slice of its own (the processes a test starts
    inherit the worker's name): two tests running at once in two workers never get the same
    port, where one would otherwise find the other's rendezvous store there.
    """
    high = _ephemeral_low()
    low = max(1024, high - 16000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (high - low) // max(1, workers)
    low, high = low + (index % max(1, workers)) * width, low + (index % max(1, workers) + 1) * width
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port between {low} and {high}")
