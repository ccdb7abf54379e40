"""The control channel over a real Unix socket: mode 0600, one JSON line each way, clear errors."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

from supervisor.ops.control import ControlServer, send


async def test_commands_bad_input_and_the_socket_mode(tmp_path: Path) -> None:
    seen: list[str] = []

    async def handler(command: str, arg: str | None = None) -> tuple[bool, str]:
        seen.append(command)
        return True, f"did {command}"

    path = tmp_path / "control.sock"
    server = ControlServer(path, handler)
    await server.start()
    assert (path.stat().st_mode & 0o777) == 0o600
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, send, path, "restart") == {"ok": True, "message": "did restart"}
    unknown = await loop.run_in_executor(None, send, path, "explode")
    assert unknown["ok"] is False and "unknown command 'explode'" in str(unknown["message"])

    def garbage() -> dict[str, object]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            s.sendall(b"not json\n")
            answer: dict[str, object] = json.loads(s.makefile().readline())
            return answer

    bad = await loop.run_in_executor(None, garbage)
    assert bad["ok"] is False and "send one JSON line" in str(bad["message"])
    assert seen == ["restart"]
    await server.close()
    assert not path.exists()
