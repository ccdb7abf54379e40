"""`alerts test` and `doctor` (issue 28, item 6): proof before 3 a.m., as the operator runs them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers.processes import free_port
from tests.helpers.receivers import Receiver

ROOT = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, str(ROOT / "tests" / "helpers" / "fake_vllm.py")]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=120)


def write_config(tmp_path: Path, extra: str = "", engine: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f"""
[engine]
model = "fake-model"
port = {free_port()}
command = {json.dumps(FAKE)}
{engine}

[state]
dir = "{tmp_path / 'state'}"

[admin]
listen = "127.0.0.1:{free_port()}"
{extra}
""")
    return path


def test_alerts_test_sends_one_page_per_hook_resolves_it_and_says_which_failed_without_secrets(
        tmp_path: Path, receiver: Callable[..., Receiver]) -> None:
    pd, hook, slack, sms = receiver(status=202), receiver(), receiver(), receiver(status=401)
    marker = tmp_path / "command-ran.json"
    config = write_config(tmp_path, f"""
[[alerts.hooks]]
type = "pagerduty"
url = "{pd.url}/v2/enqueue"
routing_key_env = "PD_KEY"

[[alerts.hooks]]
type = "webhook"
url = "{hook.url}/hook?token=s3cr3t-query"

[[alerts.hooks]]
type = "slack"
url = "{slack.url}/services/T0/B0/s3cr3t-path"

[[alerts.hooks]]
type = "twilio"
url = "{sms.url}"
account_sid = "AC1"
auth_token_env = "TW_TOKEN"
from = "+15550001"
to = ["+15550002"]

[[alerts.hooks]]
type = "command"
argv = ["{sys.executable}", "-c", "import sys; open({str(marker)!r}, 'w').write(sys.stdin.read())"]
""")
    r = run_cli("alerts", "test", "--resolve", "--config", str(config),
                env={"PD_KEY": "rk-s3cr3t", "TW_TOKEN": "tw-s3cr3t"})
    assert r.returncode == 1, r  # Twilio answered 401
    lines = r.stdout.splitlines()
    assert lines[0] == "pagerduty (127.0.0.1): sent, resolved"
    assert lines[1] == "webhook (127.0.0.1): sent, resolved" and lines[2] == "slack (127.0.0.1): sent, resolved"
    assert lines[3] == "twilio (127.0.0.1): FAILED: twilio refused 1 of 1 numbers (twilio answered HTTP 401)"
    assert lines[4].startswith("command (") and lines[4].endswith(": sent, resolved")
    assert "s3cr3t" not in r.stdout + r.stderr
    trigger, resolve = (x.json() for x in pd.requests)
    assert trigger["event_action"] == "trigger" and trigger["payload"]["severity"] == "error"  # the hook's floor
    assert "TEST" in trigger["payload"]["summary"] and resolve["event_action"] == "resolve"
    assert resolve["dedup_key"] == trigger["dedup_key"]
    assert [x.json()["event"] for x in hook.requests] == ["test", "test_resolved"]
    assert json.loads(marker.read_text())["event"] == "test_resolved"
    # Without --resolve: the page stays open (on-call sees it arrive); a missing secret names its variable.
    r2 = run_cli("alerts", "test", "--config", str(config), env={"PD_KEY": "rk-s3cr3t"})
    assert r2.returncode == 1 and "twilio (127.0.0.1): FAILED: alerts.hooks.auth_token_env: $TW_TOKEN" in r2.stdout
    assert [x.json()["event_action"] for x in pd.requests] == ["trigger", "resolve", "trigger"]
    empty = run_cli("alerts", "test", "--config", str(write_config(tmp_path)))
    assert empty.returncode == 1 and "nothing would page anybody" in empty.stdout


def _findings(r: subprocess.CompletedProcess[str]) -> dict[str, list[dict[str, Any]]]:
    doc = json.loads(r.stdout)
    out: dict[str, list[dict[str, Any]]] = {}
    for f in doc["findings"]:
        out.setdefault(f["check"], []).append(f)
    return out


def test_doctor_finds_a_taken_port_a_world_writable_state_dir_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    config = write_config(tmp_path)
    ok = run_cli("doctor", "--cpu", "--json", "--config", str(config))
    found = _findings(ok)
    assert ok.returncode == 0, ok.stdout
    assert {f["level"] for f in found["ports"]} == {"ok"} and found["state_dir"][0]["level"] == "ok"
    assert found["gpu"][0]["level"] == "skip" and found["engine_args"][0]["level"] == "skip"  # the stand-in
    assert found["shm"][0]["level"] in ("ok", "warn") and found["py_spy"][0]["level"] in ("ok", "warn")
    (tmp_path / "state").chmod(0o777)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with taken:
        port = taken.getsockname()[1]
        config.write_text(config.read_text().replace("[state]", f"[gateway]\nlisten = \"127.0.0.1:{port}\"\n\n[state]"))
        bad = run_cli("doctor", "--cpu", "--config", str(config))
    assert bad.returncode == 1, bad.stdout
    assert f"fail  ports        gateway.listen 127.0.0.1:{port}: already in use" in bad.stdout
    assert "warn  state_dir" in bad.stdout and "writable by every user" in bad.stdout
    # Without --cpu on a host with no NVIDIA driver: the GPU check fails and says how to skip it.
    nogpu = run_cli("doctor", "--json", "--config", str(write_config(tmp_path)))
    if nogpu.returncode == 1 and _findings(nogpu)["gpu"][0]["level"] == "fail":
        assert "doctor --cpu" in _findings(nogpu)["gpu"][0]["message"]
