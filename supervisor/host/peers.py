"""Who is connected to an engine's port: this process (the gateway) or someone else.

Read once from the kernel's TCP tables, only the lines of the engine's port decoded, and the
sockets of each process from its descriptors. psutil's ``Process.net_connections`` decodes every
line of both tables once per process: with the engine's three processes and this one that took
58 ms on the H100, between a settled death and its kill, all of it on a failover's path (2,300
lines on a busy test host took 54 ms). Where the tables cannot be read (not Linux), psutil."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator

import psutil

MAPPED = "::ffff:"  # an IPv4 peer seen on an IPv6 socket
HEX_MAPPED = "0000000000000000FFFF0000"  # the same in the kernel's tables
ESTABLISHED = "01"
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
Row = tuple[tuple[str, int], tuple[str, int], str, int]  # local, remote, state, inode


def outside_clients(pids: Collection[int], port: int) -> int:
    """How many TCP connections the processes ``pids`` (an engine's tree) hold open on ``port``
    whose other end is not a socket of this process; ``len(pids)`` or more when that cannot be
    read (unknown counts as someone)."""
    try:
        rows = list(_rows(port))
        ours = _socket_inodes(os.getpid())
    except OSError:
        return _outside_by_psutil(pids, port)
    our_ends = {local for local, remote, _, inode in rows if inode in ours and remote[1] == port}
    outside = 0
    for pid in pids:
        try:
            theirs = _socket_inodes(pid)
        except FileNotFoundError:
            continue  # gone
        except OSError:
            outside += 1
            continue
        outside += sum(1 for local, remote, state, inode in rows
                       if inode in theirs and local[1] == port and state == ESTABLISHED
                       and remote not in our_ends)
    return outside


def _rows(port: int) -> Iterator[Row]:
    """The lines of the kernel's TCP tables with ``port`` at either end."""
    suffix = f":{port:04X}"
    for table in TABLES:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:
            if table.endswith("6"):
                continue  # no IPv6 on this host
            raise
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and (fields[1].endswith(suffix) or fields[2].endswith(suffix)):
                yield _end(fields[1]), _end(fields[2]), fields[3], int(fields[9])


def _end(hex_end: str) -> tuple[str, int]:
    """An address and port as the tables write them; an IPv4-mapped IPv6 address as its IPv4."""
    ip, port = hex_end.split(":")
    return (ip[len(HEX_MAPPED):] if ip.startswith(HEX_MAPPED) else ip, int(port, 16))


def _socket_inodes(pid: int) -> set[int]:
    fd_dir = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except FileNotFoundError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _addr(ip: str, port: int) -> tuple[str, int]:
    return (ip[len(MAPPED):] if ip.startswith(MAPPED) else ip, port)


def _outside_by_psutil(pids: Collection[int], port: int) -> int:
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
