"""`vllm-supervisor doctor`: what on this host would stop, slow or blind a supervised engine, found
before it does.

Each check gives findings (check, level, message): ``ok``, ``warn`` (works, worse), ``fail`` (a
start or a recovery would fail, or on-call would be blind), ``skip`` (not applicable here). The
command exits 1 when any check fails, so CI and provisioning can gate on it. No finding carries a
secret (the engine's arguments are masked, alert secrets are named by their variable only).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from supervisor.bounds import GIB, MIB
from supervisor.config import Config, EngineConfig, redact
from supervisor.engine import launch
from supervisor.host import preflight
from supervisor.host.gpu import Nvml
from supervisor.host.real import py_spy
from supervisor.ops.alerts import paging
from supervisor.profile import Knob

# vLLM's processes share tensors through /dev/shm; a container's default is 64 MiB
SHM_WANTED = 1 * GIB
ARGCHECK = Path(__file__).resolve().parents[1] / "child" / "vllm_argcheck.py"
ARGCHECK_TIMEOUT_S = 180.0  # the probe imports vLLM (seconds to a minute on a small host)


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # ok, warn, fail, skip
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"check": self.check, "level": self.level, "message": self.message}


def diagnose(cfg: Config, *, cpu: bool = False, nvml: Callable[[], Nvml] = Nvml,
             engine_args: bool = True) -> list[Finding]:
    """Every check, in the order an operator fixes things."""
    running = supervisor_running(cfg)
    out = list(_preflight(cfg))
    out += list(_gpu(cfg, nvml,
                     running)) if not cpu else [Finding("gpu", "skip", "--cpu: a CPU engine")]
    out += list(_ports(cfg, running))
    out += list(_state_dir(cfg.state.dir))
    out += list(_stack_dumps())
    out += list(_shm())
    out += list(_engine_args(cfg)) if engine_args else []
    return out


def supervisor_running(cfg: Config) -> bool:
    """A supervisor answers on this config's admin port (its engine then holds the card and the
    ports)."""
    host, port = cfg.admin.host_port
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=1.0):
            return True
    except OSError:  # refused, timed out, or an HTTP error: none of ours
        return False


def _preflight(cfg: Config) -> Iterator[Finding]:
    errors, warnings = preflight.preflight(cfg)
    warnings += paging.double_pages(cfg.alerts.hooks)
    for name, msg in errors:
        yield Finding("config", "fail", f"{name}: {msg}")
    for name, msg in warnings:
        yield Finding("config", "warn", f"{name}: {msg}")
    if not errors and not warnings:
        yield Finding(
            "config", "ok",
            "the engine command, its vLLM, the model path and the alert secrets are there")


def _gpu(cfg: Config, nvml: Callable[[], Nvml], running: bool) -> Iterator[Finding]:
    nv = nvml()
    try:
        if not nv.available:
            yield Finding(
                "gpu", "fail",
                "NVML cannot be loaded (no NVIDIA driver, or nvidia-ml-py missing): the "
                "supervisor cannot see GPU memory; `doctor --cpu` for a CPU engine")
            return
        devices = cfg.engine.devices()
        snaps = nv.snapshot(devices)
        driver = nv.driver_version() or "unknown"
        if not snaps:
            yield Finding("gpu", "fail",
                          f"driver {driver}: no device matches CUDA_VISIBLE_DEVICES={devices}")
            return
        yield Finding(
            "gpu", "ok", f"driver {driver}; devices {', '.join(str(s.index) for s in snaps)} "
            f"({', '.join(f'{s.total / GIB:.1f} GiB' for s in snaps)})")
        # the engine's, unless set
        order = cfg.engine.environment().get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        if order != "PCI_BUS_ID":
            yield Finding(
                "gpu", "warn",
                f"CUDA_DEVICE_ORDER={order}: CUDA may number the cards differently from "
                "nvidia-smi and NVML, whose numbers the supervisor watches")
        if running:
            yield Finding("gpu", "skip",
                          "a supervisor runs with this config: its engine holds the card")
            return
        util = cfg.profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9
        for s in snaps:
            need = s.total * util
            if s.free < need:
                holders = ", ".join(f"pid {p} ({b / GIB:.1f} GiB)"
                                    for p, b in s.processes) or "unknown holders"
                yield Finding(
                    "gpu", "fail",
                    f"device {s.index}: {s.free / GIB:.1f} GiB free, the engine needs "
                    f"{need / GIB:.1f} GiB at gpu_memory_utilization {util:g} "
                    f"(held by {holders}); lower it, or free the card")
            else:
                yield Finding(
                    "gpu", "ok", f"device {s.index}: {s.free / GIB:.1f} GiB free, the engine needs "
                    f"{need / GIB:.1f} GiB at gpu_memory_utilization {util:g}")
    finally:
        nv.close()


def _listeners(cfg: Config) -> list[tuple[str, str, int]]:
    out = [("engine.port", cfg.engine.host, cfg.engine.port),
           ("admin.listen", *cfg.admin.host_port)]
    if cfg.admin.metrics_listen:
        out.append(("admin.metrics_listen", *cfg.admin.metrics_host_port))
    if cfg.gateway is not None:
        out.append(("gateway.listen", *cfg.gateway.host_port))
    return out


def _ports(cfg: Config, running: bool) -> Iterator[Finding]:
    if running:
        yield Finding("ports", "skip", "a supervisor runs with this config: the ports are its own")
        return
    for name, host, port in _listeners(cfg):
        problem = bind_problem(host, port)
        if problem is None:
            yield Finding("ports", "ok", f"{name} {host}:{port} is free")
        else:
            yield Finding("ports", "fail", f"{name} {host}:{port}: {problem}")


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"the address does not resolve ({exc.strerror or exc})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "already in use by another process (`ss -ltnp` names it)"
            if exc.errno == errno.EACCES:
                return "needs privileges this user lacks (a port below 1024)"
            return exc.strerror or str(exc)
    return None


def _state_dir(path: str) -> Iterator[Finding]:
    p = Path(path)
    if not p.exists():
        parent = next((q for q in p.absolute().parents if q.exists()), Path("/"))
        level = "ok" if os.access(parent, os.W_OK | os.X_OK) else "fail"
        yield Finding(
            "state_dir", level, f"{p} does not exist yet; {parent} is "
            f"{'writable: it will be made' if level == 'ok' else 'not writable'}")
        return
    st = p.stat()
    if not os.access(p, os.W_OK | os.X_OK):
        yield Finding(
            "state_dir", "fail",
            f"{p} is not writable by uid {os.geteuid()} (owner uid {st.st_uid}): "
            "learned profiles, incidents and the control socket live there")
    elif st.st_uid != os.geteuid():
        yield Finding("state_dir", "warn",
                      f"{p} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    elif st.st_mode & stat.S_IWOTH:
        yield Finding("state_dir", "warn",
                      f"{p} is writable by every user: make it 0750 (it holds incidents)")
    else:
        yield Finding("state_dir", "ok", f"{p} is this user's and writable")


def _stack_dumps() -> Iterator[Finding]:
    if py_spy() is None:
        yield Finding(
            "py_spy", "warn", "py-spy not found: a hang's incident carries no Python stacks "
            "(pip install py-spy beside the supervisor)")
    else:
        yield Finding("py_spy", "ok", f"py-spy at {py_spy()}")
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return  # no Yama: ptrace follows the classic rules (same uid)
    if scope <= 1:
        yield Finding("ptrace", "ok",
                      f"kernel.yama.ptrace_scope = {scope}: py-spy may read the engine (a child)")
    else:
        yield Finding(
            "ptrace", "warn", f"kernel.yama.ptrace_scope = {scope}: py-spy "
            f"{'needs CAP_SYS_PTRACE' if scope == 2 else 'cannot attach at all'}; "
            "a hang's incident will have no stacks")


def _shm() -> Iterator[Finding]:
    try:
        vfs = os.statvfs("/dev/shm")
    except OSError:
        yield Finding("shm", "warn", "/dev/shm is missing: vLLM's processes share tensors there")
        return
    size = vfs.f_frsize * vfs.f_blocks
    if size < SHM_WANTED:
        yield Finding(
            "shm", "warn", f"/dev/shm is {size / MIB:.0f} MiB: vLLM shares tensors between its "
            "processes there (in a container: --ipc=host or --shm-size=8g)")
    else:
        yield Finding("shm", "ok", f"/dev/shm is {size / GIB:.1f} GiB")


def _engine_args(cfg: Config) -> Iterator[Finding]:
    """[engine.args] and the managed flags, read by the installed vLLM's own serve parser."""
    prefix = cfg.engine.argv_prefix
    python = engine_python(cfg.engine)
    if python is None:
        yield Finding(
            "engine_args", "skip", f"engine.command {' '.join(prefix[:3])!r} is neither `PYTHON -m "
            "vllm...` nor `vllm serve`: its arguments are not checked")
        return
    argv = launch.build_argv(cfg.engine, cfg.profile, cfg.health.hang_timeout_s)[len(prefix):]
    if launch.takes_model_positionally(prefix):
        argv = ["--model", *argv]  # `vllm serve MODEL`: the serve parser alone reads it as --model
    secrets = cfg.engine.secrets()
    try:
        # The engine's own environment, the alert hooks' secrets withheld as from the engine itself.
        env = launch.build_env(cfg.engine, {}, "", withheld=cfg.withheld_env())
        r = subprocess.run([python, str(ARGCHECK)], input=json.dumps(argv), capture_output=True,
                           text=True, timeout=ARGCHECK_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        yield Finding("engine_args", "fail", f"could not run {python!r}: {exc}")
        return
    said = redact((r.stderr.strip().splitlines() or [""])[-1], secrets)
    if r.returncode == 0:
        yield Finding("engine_args", "ok", "the installed vLLM accepts the engine's command line")
    elif r.returncode == 3:
        yield Finding("engine_args", "warn", f"not checked: {said}")
    else:
        yield Finding("engine_args", "fail",
                      f"the installed vLLM refuses the engine's command line: {said}")


def engine_python(engine: EngineConfig) -> str | None:
    """The interpreter vLLM runs in: ``PYTHON -m vllm...``, or the `vllm` script's own (its
    shebang)."""
    prefix = engine.argv_prefix
    if engine.module_python is not None:
        return engine.module_python
    if not launch.takes_model_positionally(prefix):
        return None
    script = shutil.which(prefix[-2])
    try:
        with open(script or prefix[-2], "rb") as f:
            first = f.readline(4096).decode(errors="replace")
    except OSError:
        return None
    interpreter = first[2:].strip().split(
    )[0] if first.startswith("#!") and first[2:].strip() else ""
    return interpreter if "python" in os.path.basename(interpreter) else None


def render(findings: list[Finding]) -> str:
    width = max((len(f.check) for f in findings), default=0)
    return "\n".join(f"{f.level:<5} {f.check:<{width}}  {f.message}" for f in findings)


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.level == "fail" for f in findings) else 0


def as_json(findings: list[Finding]) -> str:
    return json.dumps({"ok": exit_code(findings) == 0, "findings": [f.as_dict() for f in findings]},
                      indent=1)
