"""Who is connected to an engine's port: this process (the gateway) or someone else."""

from __future__ import annotations

from collections.abc import Collection

import psutil

MAPPED = "::ffff:"  # an IPv4 peer seen on an IPv6 socket


def _addr(ip: str, port: int) -> tuple[str, int]:
    return (ip[len(MAPPED):] if ip.startswith(MAPPED) else ip, port)


def outside_clients(pids: Collection[int], port: int) -> int:
    """How many TCP connections the processes ``pids`` (an engine's tree) hold open on ``port``
    whose other end is not a socket of this process; ``len(pids)`` or more when that cannot be
    read (unknown counts as someone)."""
    try:
        ours = {_addr(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == port}
    except psutil.Error:
        return max(1, len(pids))
    outside = 0
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            outside += 1
            continue
        outside += sum(1 for c in conns
                       if c.raddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
                       and _addr(c.raddr.ip, c.raddr.port) not in ours)
    return outside
