"""The control channel: `vllm-supervisor restart|reset-profile|reload` talk to the running
supervisor.

A Unix stream socket in the state directory, mode 0600, and every peer's credentials checked
(SO_PEERCRED): only the supervisor's own user (or root) may use it. One JSON line in
(``{"command": "restart"}``), one JSON line out (``{"ok": true, "message": "..."}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

log = structlog.get_logger("supervisor.control")
FILENAME = "control.sock"
COMMANDS = ("restart", "reset-profile", "reload", "quarantine-clear")
Handler = Callable[[str, str | None], Awaitable[tuple[bool, str]]]  # (command, its argument)


def path_in(state_dir: str | Path) -> Path:
    return Path(state_dir) / FILENAME


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class ControlServer:
    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen on the socket; a state directory that cannot hold it costs the commands, never
        the service."""
        old = os.umask(0o177)  # created 0600: no window in which another user could connect
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)  # a socket left by a supervisor that died
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
            os.chmod(self.path, 0o600)
        except OSError as exc:
            log.error(
                "control.unavailable", path=str(self.path), error=str(exc), hint=
                "reload, restart and quarantine clear need it: make the state directory writable; "
                "SIGHUP still reloads")
        finally:
            os.umask(old)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            uid = peer_uid(sock)
            if uid not in (os.getuid(), 0):
                log.warning("control.refused", peer_uid=uid)
                await self._answer(writer, False,
                                   "refused: only the supervisor's own user may control it")
                return
            try:
                line = await asyncio.wait_for(reader.readline(), 5.0)
                doc = json.loads(line)
                command = str(doc["command"])
                arg = doc.get("arg")
                arg = str(arg) if arg is not None else None
            except (TimeoutError, ValueError, KeyError, TypeError):
                await self._answer(
                    writer, False,
                    'send one JSON line: {"command": "restart|reset-profile|reload"}')
                return
            if command not in COMMANDS:
                await self._answer(writer, False,
                                   f"unknown command {command!r}; known: {', '.join(COMMANDS)}")
                return
            log.info("control.command", command=command, peer_uid=uid)
            ok, message = await self.handler(command, arg)
            await self._answer(writer, ok, message)
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, ok: bool, message: str) -> None:
        writer.write(json.dumps({"ok": ok, "message": message}).encode() + b"\n")
        await writer.drain()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)


def send(path: Path, command: str, timeout: float = 30.0,
         arg: str | None = None) -> dict[str, object]:
    """Send one command to a running supervisor (blocking; for the CLI)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"command": command, "arg": arg}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    answer: dict[str, object] = json.loads(data or b'{"ok": false, "message": "no answer"}')
    return answer
