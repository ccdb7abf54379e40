"""The engine's command line and environment for one start (pure)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from supervisor.config import EngineConfig, Scalar
from supervisor.profile import Profile

# systemd's notify/watchdog variables belong to the supervisor: a child that inherited them could
# send READY=1 or pet the watchdog on our behalf.
WITHHELD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def arg_flags(args: Mapping[str, Scalar]) -> list[str]:
    """[engine.args] as flags: snake_case -> --dashed-name, true -> bare flag, false -> left out."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            continue
        else:
            out += [flag, str(value)]
    return out


def build_argv(engine: EngineConfig, profile: Profile) -> list[str]:
    return [
        *engine.argv_prefix,
        "--model", engine.model,
        "--host", engine.host,
        "--port", str(engine.port),
        *profile.flags(),
        *arg_flags(engine.args),
    ]


def build_env(engine: EngineConfig, ipc_env: Mapping[str, str], hook_dir: str,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in WITHHELD_ENV}
    env.update(ipc_env)
    env.update(engine.env)
    # The hook module must import in vLLM's interpreter, wherever vLLM is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (hook_dir, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def visible_devices(env: Mapping[str, str]) -> list[int] | None:
    """Device indices from CUDA_VISIBLE_DEVICES when numeric; None means all devices."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or raw.strip() == "":
        return None
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        return None  # UUIDs: NVML indices unknown, check every device
