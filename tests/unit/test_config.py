"""Config parsing: defaults, every error names its field, and `check` prints the engine command."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from supervisor.config import ConfigError
from supervisor.config_file import load, parse
from supervisor.engine.launch import arg_flags, build_argv, build_env

MINIMAL = {"engine": {"model": "/models/llama"}}


def test_minimal_config_gets_documented_defaults() -> None:
    cfg = parse(MINIMAL)
    assert cfg.engine.port == 18000
    assert cfg.profile.max_num_batched_tokens is None  # left to vLLM unless set in [profile]
    assert cfg.restart.max_consecutive_failures == 5
    assert cfg.ladder.order == ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization")
    assert cfg.ladder.max_num_batched_tokens == (8192, 6144, 4096, 2048)
    assert cfg.restart.max_restarts == 5
    assert cfg.admin.listen == "127.0.0.1:8001"


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ({}, "engine.model", "required"),
        ({**MINIMAL, "restart": {"max_restart": 3}}, "restart.max_restart", "unknown key"),
        ({**MINIMAL, "restart": {"max_restarts": "five"}}, "restart.max_restarts", "integer"),
        ({**MINIMAL, "profile": {"gpu_memory_utilization": 1.5}}, "profile.gpu_memory_utilization", "(0, 1]"),
        ({**MINIMAL, "profile": {"max_num_batched_tokens": 100}}, "profile.max_num_batched_tokens", "floor"),
        ({**MINIMAL, "ladder": {"max_num_batched_tokens": [2048, 4096]}}, "ladder.max_num_batched_tokens",
         "descending"),
        ({"engine": {"model": "m", "port": 70000}}, "engine.port", "1-65535"),
        ({"engine": {"model": "m", "host": "0.0.0.0"}}, "engine.host", "loopback"),
        ({"engine": {"model": "m", "args": {"max_num_seqs": 4}}}, "engine.args.max_num_seqs", "[profile]"),
        ({"engine": {"model": "m", "args": {"port": 4}}}, "engine.args.port", "[engine] port"),
        ({**MINIMAL, "admin": {"listen": "8001"}}, "admin.listen", "HOST:PORT"),
        ({**MINIMAL, "admin": {"listen": "0.0.0.0:8001"}}, "admin.listen", "loopback"),
        ({**MINIMAL, "bogus": {}}, "bogus", "unknown section"),
        ({**MINIMAL, "warmup": {"enabled": "yes"}}, "warmup.enabled", "true or false"),
    ],
)
def test_errors_name_the_field_and_what_is_allowed(raw: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(raw)
    names = [name for name, _ in err.value.problems]
    assert field in names, err.value
    assert words in str(err.value)


def test_all_errors_are_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        parse({**MINIMAL, "restart": {"max_restarts": -1, "window_s": 0}})
    assert {"restart.max_restarts", "restart.window_s"} <= {n for n, _ in err.value.problems}


def test_config_is_frozen() -> None:
    cfg = parse(MINIMAL)
    with pytest.raises(AttributeError):
        cfg.engine.port = 1  # type: ignore[misc]


def test_engine_command_renders_profile_then_passthrough_flags() -> None:
    cfg = parse({"engine": {"model": "/m", "port": 18001, "command": ["vllm", "serve"],
                            "args": {"kv_cache_memory_bytes": 268435456, "enforce_eager": True,
                                     "trust_remote_code": False}},
                 "profile": {"max_num_batched_tokens": 6144, "max_num_seqs": 10, "gpu_memory_utilization": 0.9,
                             "max_model_len": 4096}})
    assert build_argv(cfg.engine, cfg.profile) == [
        "vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "18001",
        "--max-num-batched-tokens", "6144", "--max-num-seqs", "10", "--gpu-memory-utilization", "0.9",
        "--max-model-len", "4096",
        "--kv-cache-memory-bytes", "268435456", "--enforce-eager", "--no-trust-remote-code"]


def test_knobs_left_out_of_the_profile_keep_vllms_defaults() -> None:
    cfg = parse({"engine": {"model": "/m", "command": ["/opt/vllm/bin/python", "-m",
                                                       "vllm.entrypoints.openai.api_server"]}})
    argv = build_argv(cfg.engine, cfg.profile)
    assert argv[3:] == ["--model", "/m", "--host", "127.0.0.1", "--port", "18000"]


def test_arg_flags_dash_keys_booleans_lists_and_tables() -> None:
    assert arg_flags({"a_b": 1, "c": True, "enable_prefix_caching": False}) == [
        "--a-b", "1", "--c", "--no-enable-prefix-caching"]
    assert arg_flags({"disable_log_stats": False, "headless": True}) == ["--headless"]  # store_true only
    assert arg_flags({"lora_modules": ["a=/l/a", "b=/l/b"]}) == ["--lora-modules", "a=/l/a", "b=/l/b"]
    assert arg_flags({"compilation_config": {"level": 3}}) == ["--compilation-config", '{"level":3}']


def test_list_and_table_args_parse_and_render() -> None:
    cfg = parse({"engine": {"model": "m", "args": {"lora_modules": ["a=/l/a"], "override_generation_config":
                                                   {"temperature": 0.5}}}})
    assert "--lora-modules" in build_argv(cfg.engine, cfg.profile)


@pytest.mark.parametrize("var", ["VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"])
def test_engine_env_cannot_switch_off_the_ipc_channel(var: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse({"engine": {"model": "m", "env": {var: "0"}}})
    assert f"engine.env.{var}" in str(err.value) and "refused" in str(err.value)


def test_engine_args_cannot_replace_the_logging_config() -> None:
    with pytest.raises(ConfigError) as err:
        parse({"engine": {"model": "m", "args": {"logging_config.pylogging_config_file": "/x.json"}}})
    assert "engine.args.logging_config.pylogging_config_file" in str(err.value)


def test_a_missing_model_does_not_hide_other_engine_errors() -> None:
    with pytest.raises(ConfigError) as err:
        parse({"engine": {"port": 70000}, "restart": {"max_restarts": "x"}})
    names = {n for n, _ in err.value.problems}
    assert {"engine.model", "engine.port", "restart.max_restarts"} <= names


def test_vllm_log_level_is_honoured_by_the_logging_config() -> None:
    from supervisor.engine.ipc import logging_config
    from supervisor.engine.launch import vllm_log_level

    cfg = parse({"engine": {"model": "m", "args": {"log_level": "error"}}})
    assert vllm_log_level(cfg.engine) == "ERROR"
    lc = logging_config("/s", "ERROR")
    assert lc["handlers"]["console"]["level"] == "ERROR"
    assert lc["loggers"]["vllm"]["level"] == "WARNING"  # our event handler still gets WARNING+
    assert vllm_log_level(parse({"engine": {"model": "m", "env": {"VLLM_LOGGING_LEVEL": "debug"}}}).engine) == "DEBUG"


def test_notify_socket_is_not_passed_to_the_engine() -> None:
    cfg = parse({"engine": {"model": "m", "env": {"CUDA_VISIBLE_DEVICES": "0"}}})
    env = build_env(cfg.engine, {"X": "1"}, "/hook",
                    base={"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "1", "PATH": "/bin", "PYTHONPATH": "/a"})
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["X"] == "1"
    assert env["PYTHONPATH"].split(":")[:2] == ["/hook", "/a"]


def test_load_reports_bad_toml_with_the_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[engine\nmodel=")
    with pytest.raises(ConfigError) as err:
        load(p)
    assert str(p) in str(err.value) and "TOML" in str(err.value)


def test_check_command_prints_the_effective_engine_command(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    p = tmp_path / "c.toml"
    p.write_text(f'[engine]\nmodel = "{model}"\n[state]\ndir = "{tmp_path}/s"\n[profile]\nmax_num_seqs = 8\n'
                 '[engine.args]\napi_key = "sk-secret-123"\nenable_prefix_caching = false\n')
    out = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(p)],
                         capture_output=True, text=True, check=True).stdout
    assert f"vllm serve {model} " in out and "--max-num-seqs 8" in out  # the default command: vLLM's positional model
    assert "--no-enable-prefix-caching" in out
    assert "--api-key '***'" in out and "sk-secret-123" not in out


def test_check_reports_what_would_stop_a_start(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[engine]\nmodel = "/nonexistent/model"\ncommand = ["/nonexistent/vllm", "serve"]\n'
                 '[state]\ndir = "relative/state"\n')
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(p)],
                       capture_output=True, text=True)
    assert r.returncode == 0  # the config is valid; this machine is what lacks the command and the model
    assert "problem: engine.command: '/nonexistent/vllm' is not an executable" in r.stderr
    assert "problem: engine.model: local model path '/nonexistent/model' does not exist" in r.stderr
    assert "warning: state.dir: 'relative/state' is relative" in r.stderr
    assert "engine command: /nonexistent/vllm serve /nonexistent/model" in r.stdout


def test_check_strict_exits_2_on_a_problem_and_the_default_config_path_is_used(tmp_path: Path) -> None:
    """Issue 18, item 7: `check --strict`, $VLLM_SUPERVISOR_CONFIG, a bare command, a closed pipe."""
    import os

    p = tmp_path / "c.toml"
    # An interpreter that exists but has no vLLM: this test's own python.
    p.write_text(f'[engine]\nmodel = "/nonexistent/model"\ncommand = ["{sys.executable}", "-m", '
                 '"vllm.entrypoints.openai.api_server"]\n'
                 f'[state]\ndir = "{tmp_path}/s"\n')
    env = {**os.environ, "VLLM_SUPERVISOR_CONFIG": str(p)}
    plain = subprocess.run([sys.executable, "-m", "supervisor", "check"], capture_output=True, text=True, env=env)
    assert plain.returncode == 0, plain.stderr  # found through $VLLM_SUPERVISOR_CONFIG; problems are not errors
    assert "cannot import vllm" in plain.stderr and "engine.model" in plain.stderr
    strict = subprocess.run([sys.executable, "-m", "supervisor", "check", "--strict"], capture_output=True,
                            text=True, env=env)
    assert strict.returncode == 2 and "problem: engine.command" in strict.stderr
    missing = subprocess.run([sys.executable, "-m", "supervisor", "check"], capture_output=True, text=True,
                             env={**env, "VLLM_SUPERVISOR_CONFIG": str(tmp_path / "none.toml")})
    assert missing.returncode == 2 and "none.toml does not exist" in missing.stderr
    bare = subprocess.run([sys.executable, "-m", "supervisor"], capture_output=True, text=True)
    assert bare.returncode == 2 and all(c in bare.stderr for c in ("run", "check", "status", "quarantine", "plan"))
    for cmd in ("run", "check", "status", "incidents", "quarantine", "plan", "reload"):
        helptext = subprocess.run([sys.executable, "-m", "supervisor", cmd, "--help"], capture_output=True,
                                  text=True).stdout
        options = [line for line in helptext.splitlines() if line.strip().startswith("-") and "--help" not in line]
        assert all(len(line.split("  ")) > 1 or line.rstrip().endswith(",") for line in options), (cmd, options)
    # A reader that leaves early (`| head -1`) is not a traceback.
    piped = subprocess.run(f"{sys.executable} -m supervisor check --config {p} | head -c 1", shell=True,
                           capture_output=True, text=True)
    assert "Traceback" not in piped.stderr


def test_check_command_rejects_bad_config_with_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[engine]\nmodel = "/m"\n[restart]\nmax_restarts = "x"\n')
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(p)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "restart.max_restarts" in r.stderr


def test_every_config_key_is_documented_with_its_default() -> None:
    import dataclasses

    from supervisor.config import _SECTIONS, TOML_KEYS, HookConfig

    doc = (Path(__file__).parents[2] / "docs" / "interface.md").read_text()
    tables = [*_SECTIONS.items(), ("alerts.hooks", HookConfig)]
    missing = [f"{section}.{f.name}" for section, cls in tables for f in dataclasses.fields(cls)
               if f"`{TOML_KEYS.get(f.name, f.name)}`" not in doc and f"`{section}.{f.name}`" not in doc]
    assert missing == []


def test_every_default_interface_md_states_is_the_code_s_default() -> None:
    """A default written in the docs' tables (a TOML literal in backquotes) is the one the code has."""
    import dataclasses
    import re
    import tomllib

    from supervisor.config import _SECTIONS, TOML_KEYS

    doc = (Path(__file__).parents[2] / "docs" / "interface.md").read_text()
    stated: dict[tuple[str, str], Any] = {}
    section = ""
    for line in doc.splitlines():
        if m := re.match(r"^#+ .*`\[([\w.]+)\]`", line):
            section = m.group(1)
        elif (m := re.match(r"^\| `(\w+)` \| `([^`]*)` \|", line)) and section in _SECTIONS:
            with contextlib.suppress(tomllib.TOMLDecodeError):
                stated[(section, m.group(1))] = tomllib.loads(f"v = {m.group(2)}")["v"]
    wrong, checked = [], 0
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = (section, TOML_KEYS.get(f.name, f.name))
            if key not in stated:
                continue
            code = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            checked += 1
            if (list(code) if isinstance(code, tuple) else code) != stated[key]:
                wrong.append(f"{key[0]}.{key[1]}: docs {stated[key]!r}, code {code!r}")
    assert checked > 60 and wrong == []


def test_every_shipped_example_is_a_valid_config() -> None:
    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert {p.name for p in examples} >= {"cpu-tiny.toml", "gpu.toml", "gpu0.toml"}
    for p in examples:
        cfg = load(p)
        if p.name.startswith("gpu"):
            assert cfg.gateway is not None and cfg.gateway.hold_timeout_s == "auto"
            assert cfg.engine.args.get("trust_remote_code") is True


def test_every_config_error_is_reported_in_one_run_with_its_full_path() -> None:
    """Issue 18, item 6: a missing engine.model hid engine.port and engine.host; an unknown hook key hid its
    missing required keys; a bad [engine.args] value lost its key's name."""
    raw = {"engine": {"port": 70000, "host": "0.0.0.0", "args": {"lora_modules": ["a=/x", {"x": 1}],
                                                                "max_loras": [1, [2]], "seed": 7}},
           "restart": {"max_restarts": "five", "window_s": -1},
           "alerts": {"hooks": [{"type": "pagerduty", "bogus": 1}]}}
    with pytest.raises(ConfigError) as err:
        parse(raw)
    fields = [f for f, _ in err.value.problems]
    assert fields == ["engine.model", "engine.args.lora_modules[1]", "engine.args.max_loras[1]", "engine.host",
                      "engine.port", "restart.max_restarts", "restart.window_s", "alerts.hooks[0].bogus",
                      "alerts.hooks[0].routing_key_env"], fields


def test_an_engine_of_several_ranks_gets_a_bounded_distributed_timeout_from_health_unless_set() -> None:
    """Issue 19: vLLM has no watchdog across ranks; its --distributed-timeout-seconds bounds a stuck collective."""
    from supervisor.engine import launch

    def argv(args: dict[str, Any]) -> list[str]:
        cfg = parse({"engine": {"model": "m", "args": args}, "health": {"hang_timeout_s": 45}})
        return launch.build_argv(cfg.engine, cfg.profile, cfg.health.hang_timeout_s)

    tp2 = argv({"tensor_parallel_size": 2})
    assert tp2[tp2.index("--distributed-timeout-seconds") + 1] == "45"
    assert "--distributed-timeout-seconds" not in argv({})  # one rank: nothing to bound
    own = argv({"tensor_parallel_size": 2, "distributed_timeout_seconds": 600})
    assert own.count("--distributed-timeout-seconds") == 1 and own[own.index("--distributed-timeout-seconds") + 1] \
        == "600"


def test_a_spare_asked_for_without_a_gateway_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        parse({**MINIMAL, "recovery": {"spare": "on"}})
    assert "recovery.spare" in str(err.value) and "[gateway]" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({**MINIMAL, "recovery": {"spare": "yes"}})
    assert "recovery.spare" in str(err.value)
    assert parse({**MINIMAL, "recovery": {"spare": "on"}, "gateway": {}}).recovery.spare == "on"
    assert parse(MINIMAL).recovery.spare == "auto"


def test_every_numeric_key_carries_its_constraint_beside_its_field() -> None:
    """Issue 26: the range checks sat ~400 lines from their fields. Each number is now declared with its
    constraint (``checked``, ``seconds``, ``at_least``, ...); rules over several keys are the class's problems()."""
    import dataclasses
    import typing

    from supervisor import config as c

    over_several = {("RestartConfig", "backoff_max_s")}  # >= backoff_initial_s: RestartConfig.problems()
    loose = []
    for cls in (c.EngineConfig, c.LadderConfig, c.RestartConfig, c.HealthConfig, c.WarmupConfig, c.GpuConfig,
                c.AdminConfig, c.LogConfig, c.AlertsConfig, c.GatewayConfig, c.RecoveryConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            numeric = hints[f.name] in (int, float) or hints[f.name] == float | str
            if numeric and "check" not in f.metadata and (cls.__name__, f.name) not in over_several:
                loose.append(f"{cls.__name__}.{f.name}")
    assert loose == []
    with pytest.raises(ConfigError) as err:
        parse({"engine": {"model": "m"}, "restart": {"backoff_initial_s": 5, "backoff_max_s": 1},
               "gateway": {"kv_cache_high": 2}})
    assert err.value.problems == [("restart.backoff_max_s", "must be >= backoff_initial_s"),
                                  ("gateway.kv_cache_high", "must be a fraction in [0, 1] (0 switches the rule off)")]


def test_the_default_engine_command_is_vllm_serve_beside_the_supervisors_interpreter() -> None:
    """Issue 39: not `python -m vllm.entrypoints.openai.api_server`, which vLLM 0.32 calls deprecated at every start.
    The interpreter's path is not resolved: a virtualenv's python is a symlink, its `vllm` lies beside the link."""
    import os
    import sys

    from supervisor.config import EngineConfig

    prefix = EngineConfig(model="m").argv_prefix
    assert prefix == (os.path.join(os.path.dirname(sys.executable), "vllm"), "serve")
    from supervisor.recovery.standby import VLLM_CLI, entry_of

    made = entry_of(prefix)  # a standby can import ahead for it
    if os.access(os.path.join(os.path.dirname(sys.executable), "python"), os.X_OK):
        assert made is not None and made.target == VLLM_CLI and made.args_from == 1

