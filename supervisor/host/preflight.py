"""What can be seen on this machine before a start (`check --strict`, `doctor`): the engine
command and its vLLM, the model path, the alert secrets, a relative state dir. Machine
probing, kept out of the config's schema."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from supervisor.config import Config, Problems, is_local_path, read_secret


def preflight(cfg: Config, which: Any = None, exists: Any = None,
              has_module: Any = None) -> tuple[Problems, Problems]:
    """What can be seen before a start: (errors, warnings), each (field, message).

    Errors: the engine command cannot be found; its interpreter (``python -m vllm...``) has no vLLM;
    a local model path does not exist; an alert secret is not set. Warnings: a relative state.dir
    (under systemd the working directory is /).
    """
    which = which or shutil.which
    exists = exists or os.path.exists
    has_module = has_module or _interpreter_has
    errors: Problems = []
    warnings: Problems = []
    prefix = cfg.engine.argv_prefix
    exe = prefix[0]
    if not which(exe):
        errors.append(("engine.command", f"{exe!r} is not an executable file nor found on PATH"))
    elif cfg.engine.module_python is not None and not has_module(exe, "vllm"):
        errors.append(
            ("engine.command", f"{exe!r} cannot import vllm: install vLLM in that interpreter's "
             "environment, or point engine.command at one that has it"))
    if is_local_path(cfg.engine.model) and not exists(cfg.engine.model):
        errors.append(
            ("engine.model", f"local model path {cfg.engine.model!r} does not exist "
             f"(`run` waits up to engine.model_wait_s={cfg.engine.model_wait_s:g}s for it)"))
    for i, hook in enumerate(cfg.alerts.hooks):
        for key in hook.SECRET_KEYS:
            name = getattr(hook, key)
            if name and not read_secret(name):
                errors.append(
                    (f"alerts.hooks[{i}].{key}", f"${name} is not set and no systemd credential "
                     f"{name!r} exists in $CREDENTIALS_DIRECTORY"))
    if not os.path.isabs(cfg.state.dir):
        warnings.append(
            ("state.dir", f"{cfg.state.dir!r} is relative: it depends on the working directory "
             "(/ under systemd); use an absolute path"))
    return errors, warnings


def _interpreter_has(python: str, module: str) -> bool:
    """Whether ``python`` finds ``module`` (without importing it: vLLM's import takes seconds)."""
    probe = (f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else "
             "1)")
    try:
        return subprocess.run([python, "-c", probe], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
