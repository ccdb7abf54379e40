"""Parent side of the IPC channel: a Unix datagram socket per engine start, and the logging
config that makes every vLLM process send its WARNING+ records there.

vLLM applies ``VLLM_LOGGING_CONFIG_PATH`` (with ``VLLM_CONFIGURE_LOGGING=1``) in the API
server, the EngineCore and each worker, so events arrive typed from all of them; the console
handler keeps vLLM's usual output on the pipes for the log tail and the journal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from supervisor.child import vllm_hook
from supervisor.host import routes

SOCKET_NAME = "events.sock"  # in each start's (or second engine's) own directory
# One per supervisor, beside the starts' directories: the modules its engine processes imported
# (vllm_hook.watch_modules), for the next standby to import ahead.
ENGINE_MODULES = "engine-modules.txt"

log = structlog.get_logger("supervisor.engine.ipc")
HOOK_MODULE = "vllm_supervisor_hook"


def logging_config(socket_path: str, level: str = "INFO") -> dict[str, Any]:
    """A dictConfig for vLLM: its console output at vLLM's own level, plus our event handler at
    WARNING.

    The logger itself lets WARNING through even when vLLM's level is ERROR: the events must arrive
    whatever the operator wants to see on the console.
    """
    logger_level = level if logging.getLevelName(level) <= logging.WARNING else "WARNING"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": f"{HOOK_MODULE}.ConsoleFormatter"}},
        "handlers": {
            "console": {
                "class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                "stream": "ext://sys.stdout"
            },
            "supervisor": {
                "()": f"{HOOK_MODULE}.SupervisorEventHandler", "path": socket_path,
                "level": "WARNING"
            },
        },
        "loggers": {
            "vllm": {
                "handlers": ["console", "supervisor"], "level": logger_level, "propagate": False
            }
        },
    }


def prepare_child_env(run_dir: Path, socket_path: str, level: str = "INFO",
                      dev_mode: bool = False) -> dict[str, str]:
    """Write the hook module and logging config under ``run_dir``; return the env vars to add.
    ``dev_mode``: the engine serves vLLM's dev routes, which the hook then guards
    (``control_guard_env``). ``run_dir`` is a directory in the supervisor's run directory, which
    holds the engines' module list (``ENGINE_MODULES``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vllm_hook.__file__, run_dir / f"{HOOK_MODULE}.py")
    cfg = run_dir / "vllm-logging.json"
    cfg.write_text(json.dumps(logging_config(socket_path, level), indent=1))
    return {
        "VLLM_CONFIGURE_LOGGING": "1",
        "VLLM_LOGGING_CONFIG_PATH": str(cfg),
        "VLLMSUP_EVENTS": socket_path,
        "VLLMSUP_PID": str(os.getpid()),  # the hook lets us (and py-spy) read stacks under Yama
        "_VLLMSUP_HOOK_DIR": str(run_dir),
        vllm_hook.MODULES_ENV: str(run_dir.parent / ENGINE_MODULES),
        **(control_guard_env() if dev_mode else {}),
    }


def dev_mode(env: Mapping[str, str]) -> bool:
    """vLLM serves its dev routes (/sleep, /pause, /collective_rpc, ...) when
    VLLM_SERVER_DEV_MODE is set: read as vLLM reads it (``bool(int(value))``: "2" is on too);
    a value vLLM cannot read is guarded anyway."""
    value = env.get("VLLM_SERVER_DEV_MODE", "").strip()
    try:
        return int(value) != 0
    except ValueError:
        return bool(value)


def control_guard_env() -> dict[str, str]:
    """A fresh token the child hook demands on every route the public port does not serve
    (child/vllm_hook.py guard_control_routes), and the list of those it does."""
    open_paths = sorted(
        {*routes.COUNTED, *routes.OPAQUE, *routes.INFORMATIONAL, "/health", "/metrics"})
    return {
        vllm_hook.TOKEN_ENV: secrets.token_urlsafe(32),
        vllm_hook.OPEN_ROUTES_ENV: json.dumps(open_paths)
    }


def control_token(env: Mapping[str, str]) -> str | None:
    """The token an engine started with ``env`` demands on its control routes, if any."""
    return env.get(vllm_hook.TOKEN_ENV) or None


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.on_event = on_event

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            log.warning("ipc.bad_event", size=len(data))
            return
        if isinstance(event, dict):
            self.on_event(event)


class EventServer:
    """Receives JSON events on a Unix datagram socket and hands each to ``on_event``."""

    def __init__(self, path: Path, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.path = path
        self.on_event = on_event
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        if self.path.exists():
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self.on_event),
                                                           sock=sock)
        self._transport = transport

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
