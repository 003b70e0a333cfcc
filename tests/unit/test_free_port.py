"""The tests' rendezvous ports (``tests/distributed/launch.free_port``): free, and outside the kernel's
ephemeral range, where another test's gloo connections could take a port between its pick and torchrun's
bind (EADDRINUSE under two pytest workers)."""

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launch import _ephemeral_range, free_port  # noqa: E402


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    low, high = _ephemeral_range()
    assert 1024 <= low < high
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), ports
    assert len(set(ports)) > 10  # spread, not one port every time
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free
