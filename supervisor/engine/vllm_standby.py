"""A standby engine interpreter: imports vLLM now, becomes the next engine when told to.

Standard library only, and copied next to the engine's logging config (like the IPC hook), so it
runs in vLLM's own interpreter. Usage::

    python vllm_supervisor_standby.py module   vllm.entrypoints.openai.api_server [PRELOAD...]
    python vllm_supervisor_standby.py script   /path/to/server.py                 [PRELOAD...]
    python vllm_supervisor_standby.py function vllm.entrypoints.cli.main:main     [PRELOAD...]

It imports the target (module-level code only: nothing under ``if __name__ == "__main__"``) and
the PRELOAD modules, touches the file named by ``VLLM_SUPERVISOR_STANDBY_READY`` with the seconds
that took, and waits for one JSON line on stdin: ``{"argv": [...], "env": {...}}``. It then
takes that environment as its own, re-applies vLLM's logging config from it (the start's event
socket), and runs the target as ``__main__`` with that argv. End of stdin before the line (the
supervisor is gone) exits quietly. Nothing here initialises CUDA: importing torch does not.
"""

from __future__ import annotations

import importlib
import json
import logging.config
import os
import runpy
import sys
import time


def preload(mode: str, target: str, extra: list[str]) -> None:
    if mode == "module":
        importlib.import_module(target)
    elif mode == "script":
        runpy.run_path(target, run_name="__standby__")  # its imports, cached for the real run
    else:
        importlib.import_module(target.partition(":")[0])
    for name in extra:
        importlib.import_module(name)


def become(message: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    argv = [str(a) for a in message["argv"]]  # type: ignore[attr-defined]
    env = {str(k): str(v) for k, v in message["env"].items()}  # type: ignore[attr-defined]
    return argv, env


def apply_logging(env: dict[str, str]) -> None:
    """vLLM applied the standby's logging config at import; the start's names its own event socket."""
    path = env.get("VLLM_LOGGING_CONFIG_PATH")
    if env.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            logging.config.dictConfig(json.load(f))


def run(mode: str, target: str, argv: list[str]) -> None:
    """``target`` as ``__main__`` with ``argv`` after the program name, as the engine command would run it."""
    sys.argv = [target, *argv]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "script":
        runpy.run_path(target, run_name="__main__")
    else:
        module, _, func = target.partition(":")
        sys.exit(getattr(importlib.import_module(module), func)())


def main() -> None:
    mode, target, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    t0 = time.monotonic()
    preload(mode, target, extra)
    ready = os.environ.get("VLLM_SUPERVISOR_STANDBY_READY")
    if ready:
        with open(ready, "w", encoding="utf-8") as f:
            f.write(f"{time.monotonic() - t0:.3f}\n")
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    argv, env = become(json.loads(line))
    os.environ.clear()
    os.environ.update(env)
    apply_logging(env)
    run(mode, target, argv)


if __name__ == "__main__":
    main()
