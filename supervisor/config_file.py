"""The config file read: TOML decoded, every section built and type-checked against its schema
(config.py), each field's and each section's constraints checked, and every problem reported
at once with its full path."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from supervisor.config import (
    _SECTIONS,
    HOOK_TYPES,
    OPTIONAL_SECTIONS,
    SEVERITIES,
    SPARE_NEEDS_GATEWAY,
    TOML_KEYS,
    ArgValue,
    Config,
    ConfigError,
    HookConfig,
    LadderConfig,
    Scalar,
    StateConfig,
    field_problems,
    parse_listen,
)
from supervisor.profile import Profile


def load(path: str | Path) -> Config:
    """Read and validate a TOML config file; raise ConfigError naming every bad field."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError([("(file)", f"{p} does not exist")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([("(file)", f"not valid TOML: {exc}")], str(p)) from None
    return parse(raw, source=str(p))


def state_dir_of(path: str | Path) -> str:
    """[state] dir of a config file even when the rest of it is invalid (the default when
    unreadable)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
        value = raw.get("state", {}).get("dir")
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        value = None
    return value if isinstance(value, str) and value else StateConfig().dir


def parse(raw: dict[str, Any], source: str = "") -> Config:
    """Validate an already-decoded TOML document."""
    problems: list[tuple[str, str]] = []
    for name in raw:
        if name not in _SECTIONS:
            problems.append((name, f"unknown section; known: {', '.join(_SECTIONS)}"))
    built: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name in OPTIONAL_SECTIONS and name not in raw:
            continue
        table = raw.get(name, {})
        if not isinstance(table, dict):
            problems.append((name, "must be a table ([" + name + "])"))
            continue
        if name == "engine" and "model" not in table:
            problems.append(("engine.model", "required: the model path or name vLLM serves"))
            table = {**table, "model": "(missing)"}  # still check every other [engine] key
        obj = _build(cls, name, table, problems)
        if obj is not None:
            built[name] = obj
    problems.extend(_cross_checks(built))
    if problems:
        raise ConfigError(problems, source)
    return Config(**built)


def _build(cls: type, section: str, table: dict[str, Any], problems: list[tuple[str, str]]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    bad: set[str] = set()  # keys already reported: their range checks would only repeat them
    toml_to_field = {v: k for k, v in TOML_KEYS.items()}
    for key, value in table.items():
        name = f"{section}.{key}"
        field_name = toml_to_field.get(key, key)
        if field_name not in fields or key in TOML_KEYS:
            known = ", ".join(TOML_KEYS.get(f, f) for f in fields)
            hint = (" (secrets are read from the environment: use routing_key_env / auth_token_env)"
                    if key in ("routing_key", "auth_token") else "")
            problems.append((name, f"unknown key{hint}; known keys of [{section}]: {known}"))
            continue
        tables = _tables_of(hints[field_name])
        if tables is not None:
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                problems.append((name, f"must be an array of tables ([[{name}]])"))
                continue
            items = [_build(tables, f"{name}[{i}]", v, problems) for i, v in enumerate(value)]
            if any(item is None for item in items):
                bad.add(key)
            else:
                kwargs[field_name] = tuple(items)
            continue
        try:
            kwargs[field_name] = _coerce(hints[field_name], value, name)
        except _FieldError as exc:
            problems.extend((e.where, str(e)) for e in (exc, *exc.more))
            bad.add(key)
    # Every other field is still checked, with its default standing in for what was wrong: one run
    # of `check` names every problem of the file, not the first of each table.
    try:
        obj = cls(**kwargs)
    # a required key of this table is missing: reported by the caller or the hook checks
    except TypeError:
        return None
    problems.extend(p for p in _range_checks(section, obj)
                    if p[0].removeprefix(f"{section}.").split("[")[0] not in bad)
    return obj if not bad else None


def _tables_of(tp: Any) -> type | None:
    """The dataclass of a ``tuple[SomeConfig, ...]`` field (an array of tables), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
        return args[0]  # type: ignore[return-value]
    return None


class _FieldError(ValueError):
    """A value of the wrong type; ``where`` is its full path (``engine.args.lora_modules[1]``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where
        self.more: list[_FieldError] = []  # the other bad entries of the same table


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp == ArgValue:
        if isinstance(value, (str, int, float, bool, dict)):
            return value
        if isinstance(value, list):
            for i, v in enumerate(value):
                if not isinstance(v, (str, int, float, bool)):
                    raise _FieldError(
                        f"{name}[{i}]", f"must be a string, number or boolean (a flag's value), "
                        f"got {type(v).__name__}")
            return value
        raise _FieldError(name, "must be a string, number, boolean, list of those, or a table")
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if tp == Scalar or set(inner) == {str, int, float, bool}:
            if isinstance(value, (str, int, float, bool)):
                return value
            raise _FieldError(name,
                              f"must be a string, number or boolean, got {type(value).__name__}")
        if set(inner) == {float, str}:  # a number of seconds, or a word such as "auto"
            if isinstance(value, str):
                return value
            return _coerce(float, value, name)
        return _coerce(inner[0], value, name)
    if origin is tuple:
        if not isinstance(value, list):
            raise _FieldError(name, f"must be a list, got {type(value).__name__}")
        return tuple(_coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _FieldError(name, f"must be a table, got {type(value).__name__}")
        out: dict[str, Any] = {}
        errors: list[_FieldError] = []
        for k, v in value.items():  # every bad entry of a table is named, not the first alone
            try:
                out[str(k)] = _coerce(args[1], v, f"{name}.{k}")
            except _FieldError as exc:
                errors.extend([exc, *exc.more])
        if errors:
            errors[0].more = errors[1:]
            raise errors[0]
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise _FieldError(name, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(name, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _FieldError(name, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _FieldError(name, f"must be a string, got {value!r}")
        return value
    raise _FieldError(name, f"unsupported type {tp}")  # pragma: no cover - schema bug


def _range_checks(section: str, obj: Any) -> list[tuple[str, str]]:
    """Each field's own constraint, then its class's rules over several fields (``problems()``)."""
    if isinstance(obj, HookConfig):
        return _hook_problems(section, obj)
    own = field_problems(obj) if dataclasses.is_dataclass(obj) else []
    rules = obj.problems() if hasattr(obj, "problems") else []
    return [(f"{section}.{k}", m) for k, m in (*own, *rules)]


def _hook_problems(where: str, h: HookConfig) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []

    def need(key: str, ok: bool, msg: str) -> None:
        if not ok:
            out.append((f"{where}.{TOML_KEYS.get(key, key)}", msg))

    need("type", h.type in HOOK_TYPES, f"must be one of {', '.join(HOOK_TYPES)}, got {h.type!r}")
    need("min_severity", h.min_severity in ("", *SEVERITIES),
         f"must be one of {', '.join(SEVERITIES)}")
    if h.type in ("webhook", "slack", "pagerduty", "twilio", "alertmanager"):
        need("url", h.endpoint.startswith(("http://", "https://")),
             f"must be an http(s) URL{' (required for ' + h.type + ')' if not h.endpoint else ''}")
    need("auth_header_env", not h.auth_header_env or h.type in ("webhook", "alertmanager"),
         "only webhook and alertmanager hooks send an Authorization header")
    need("hmac_secret_env", not h.hmac_secret_env or h.type == "webhook",
         "only webhook hooks sign their bodies")
    if h.type == "pagerduty":
        need(
            "routing_key_env", bool(h.routing_key_env),
            "required: the environment variable (or systemd "
            "credential) that holds the PagerDuty routing key")
    if h.type == "twilio":
        need("account_sid", bool(h.account_sid), "required: the Twilio account SID")
        need(
            "auth_token_env", bool(h.auth_token_env),
            "required: the environment variable (or systemd "
            "credential) that holds the Twilio auth token")
        need("from_", bool(h.from_), "required: the sending number")
        need("to", bool(h.to), "required: a list of numbers to text")
    if h.type == "command":
        need("argv",
             bool(h.argv) and all(h.argv),
             "required: the command and its arguments, run without a shell")
    need("timeout_s", h.timeout_s > 0, "must be > 0 seconds")
    need("max_per_hour", h.max_per_hour >= 1, "must be >= 1")
    need("attempts", h.attempts >= 1, "must be >= 1")
    need("retry_for_s", h.retry_for_s >= 0, "must be >= 0 seconds")
    return out


def _cross_checks(built: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    profile: Profile | None = built.get("profile")
    ladder: LadderConfig | None = built.get("ladder")
    if profile is not None and ladder is not None:
        floors = {"max_num_batched_tokens": ladder.max_num_batched_tokens_floor,
                  "max_num_seqs": ladder.max_num_seqs_floor,
                  "gpu_memory_utilization": ladder.gpu_memory_utilization_floor,
                  "max_model_len": ladder.max_model_len_floor}
        for knob, floor in floors.items():
            v = getattr(profile, knob)
            if v is not None and v < floor:
                out.append((f"profile.{knob}", f"{v} is below ladder.{knob}_floor ({floor})"))
    out.extend(_port_clashes(built))
    recovery = built.get("recovery")
    if recovery is not None and recovery.spare == "on" and built.get("gateway") is None:
        out.append(("recovery.spare", f'"on" needs a [gateway] table: {SPARE_NEEDS_GATEWAY}'))
    return out


def _port_clashes(built: dict[str, Any]) -> list[tuple[str, str]]:
    """Listeners on one port; an address already refused above is left out (it has its own
    message)."""
    engine, admin, gateway = built.get("engine"), built.get("admin"), built.get("gateway")
    if engine is None or admin is None or not isinstance(engine.port, int):
        return []
    out: list[tuple[str, str]] = []
    admin_at = parse_listen(admin.listen)
    admin_port = admin_at[1] if admin_at else None
    if admin_port == engine.port:
        out.append(("admin.listen", "must not use the engine's internal port"))
    gateway_at = parse_listen(gateway.listen) if gateway is not None else None
    if gateway_at is not None and gateway_at[1] in (engine.port, admin_port):
        out.append(
            ("gateway.listen", "must not use the engine's internal port or admin.listen's port"))
    metrics_at = parse_listen(admin.metrics_listen) if admin.metrics_listen else None
    if metrics_at is not None and metrics_at[1] in (engine.port, admin_port):
        out.append(
            ("admin.metrics_listen", "must not use the engine's port or admin.listen's port"))
    return out
