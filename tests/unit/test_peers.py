"""Who is connected to an engine's port (supervisor/host/peers.py), read from real sockets of real processes."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from supervisor.host import peers

SERVER = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
held = []
while True:
    c, _ = s.accept(); held.append(c); c.sendall(b"k")
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection(("127.0.0.1", int(sys.argv[1]))); c.recv(1)
print("connected", flush=True); time.sleep(60)
"""


@pytest.fixture
def engine() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield proc, port
    proc.kill()
    proc.wait()


def count_both_ways(pids: list[int], port: int) -> tuple[int, int]:
    return peers.outside_clients(pids, port), peers._outside_by_psutil(pids, port)


def test_the_gateways_connections_are_not_clients_and_anyone_elses_are(
        engine: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = engine
    assert count_both_ways([proc.pid], port) == (0, 0)  # listening, nobody connected
    ours = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    outsider = None
    try:
        for c in ours:
            assert c.recv(1) == b"k"  # accepted
        assert count_both_ways([proc.pid], port) == (0, 0)  # only this process (the gateway)
        outsider = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
        assert outsider.stdout is not None and outsider.stdout.readline().strip() == "connected"
        assert count_both_ways([proc.pid], port) == (1, 1)
        assert count_both_ways([proc.pid], port + 1 if port < 65535 else port - 1) == (0, 0)  # another port
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        assert peers.outside_clients([proc.pid, gone.pid], port) == 1  # a process gone holds nothing
    finally:
        for c in ours:
            c.close()
        if outsider is not None:
            outsider.kill()
            outsider.wait()
