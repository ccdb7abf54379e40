"""One paging path (issue 39): the rules' severities are the hooks', a rule that mirrors a hook's page is recorded,
not paged, and a config that would page one outage twice is told so by `check`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from supervisor.config import SEVERITIES, AlertsConfig, HookConfig
from supervisor.engine_states import Failure, FailureKind
from supervisor.event_stream import Fatal
from supervisor.ops.alerts.channels import Alertmanager
from supervisor.ops.alerts.paging import PAGE_SEVERITIES, double_pages, pages_for
from supervisor.ops.alerts.rules import CLEARS_ON, AlertRules

from tests.helpers.events import crash_and_recover, failed, lowered, sc

ROOT = Path(__file__).resolve().parents[2]
# Each rule that mirrors a page the supervisor's hooks send, and that page.
MIRRORS = {"VllmEngineNotReady": "outage", "VllmSupervisorFatal": "fatal", "VllmDegraded": "profile_lowered",
           "VllmRestartsFrequent": "engine_restarted"}


def rules() -> list[dict[str, object]]:
    out: list[dict[str, object]] = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())["groups"][0][
        "rules"]
    return out


def test_the_pages_and_their_severities_are_the_rules_own() -> None:
    """PAGE_SEVERITIES (what `check` reasons with) is what the rules send, read off a run of the rules."""
    assert set(PAGE_SEVERITIES) == set(CLEARS_ON)
    r = AlertRules(AlertsConfig(escalate_after=2, dedup_window_s=0, page_after_s=60), "gpu-7", started_at=0.0)
    sent = r.on_event(sc("WARMING", "READY"), 0.0)
    for i in range(2):
        for ev in crash_and_recover():
            sent += r.on_event(ev, 10.0 + i)
    sent += r.on_event(lowered(), 20.0) + r.on_event(failed("hang", "no token progress"), 21.0)
    sent += r.on_event(sc("READY", "STOPPING"), 30.0) + r.tick(100.0, 1_700_000_000.0)
    sent += r.on_event(Fatal(at=1.0, exit_code=5, reason="nothing left to lower",
                             failure=Failure(FailureKind.RUNTIME_OOM, "CUDA out of memory")), 101.0)
    pages = {(a.event, a.severity) for a in sent if a.clears_on}
    assert {e for e, _ in pages} >= {"outage", "fatal", "engine_restarted", "hang_detected", "profile_lowered"}
    for event, severity in pages:
        assert severity in PAGE_SEVERITIES[event], (event, severity)


def test_every_rule_speaks_the_hooks_severities_and_a_mirror_carries_its_pages_severity_and_label() -> None:
    for rule in rules():
        labels = rule["labels"]
        assert isinstance(labels, dict)
        assert labels["severity"] in SEVERITIES, rule["alert"]
        mirrored = MIRRORS.get(str(rule["alert"]))
        assert labels.get("paged_by") == ("vllm-supervisor" if mirrored else None), rule["alert"]
        if mirrored:
            assert labels["severity"] in PAGE_SEVERITIES[mirrored], rule["alert"]


def test_503s_while_the_engine_is_down_are_the_outages_page_not_a_second_one() -> None:
    (rule,) = [r for r in rules() if r["alert"] == "VllmClientsGetting503"]
    assert 'and on (instance) vllm_supervisor_engine_state{state="READY"} == 1' in str(rule["expr"])


def hook(kind: str, floor: str = "") -> HookConfig:
    return HookConfig(type=kind, min_severity=floor)


@pytest.mark.parametrize(("hooks", "warned"), [
    ([hook("alertmanager"), hook("pagerduty")], [("alerts.hooks[1]", "engine_restarted, fatal, outage")]),
    ([hook("pagerduty"), hook("webhook"), hook("alertmanager", "critical")], [("alerts.hooks[0]", "fatal")]),
    ([hook("alertmanager", "warning"), hook("twilio")], [("alerts.hooks[1]", "fatal")]),
    ([hook("pagerduty"), hook("twilio")], []),  # one path: SMS beside PagerDuty for critical is the defaults' choice
    ([hook("alertmanager"), hook("slack"), hook("webhook"), hook("command")], []),
    ([hook("alertmanager", "critical"), hook("pagerduty", "info")], [("alerts.hooks[1]", "fatal")]),
])
def test_check_names_the_hooks_that_would_page_one_outage_twice(hooks: list[HookConfig],
                                                                 warned: list[tuple[str, str]]) -> None:
    got = double_pages(hooks)
    assert [(field, msg.split("both page for ")[1].split(":")[0]) for field, msg in got] == warned
    for _, msg in got:
        assert "One paging path" in msg and "min_severity" in msg


def test_pages_for_follows_the_severity_floor() -> None:
    assert pages_for(hook("twilio")) == {"fatal"}
    assert pages_for(hook("pagerduty")) == {"outage", "fatal", "engine_restarted"}
    assert pages_for(hook("pagerduty", "warning")) == set(PAGE_SEVERITIES)


def test_check_prints_the_double_page_warning(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[engine]\nmodel = "m"\n[state]\ndir = "{tmp_path}"\n'
                      '[[alerts.hooks]]\ntype = "alertmanager"\nurl = "http://127.0.0.1:9093"\n'
                      '[[alerts.hooks]]\ntype = "pagerduty"\nrouting_key_env = "PD_KEY"\n')
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(config)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PD_KEY": "secret-routing-key"})
    assert r.returncode == 0, r.stderr
    assert "warning: alerts.hooks[1]: pagerduty and alerts.hooks[0] (alertmanager) both page for" in r.stderr
    assert "secret-routing-key" not in r.stdout + r.stderr


def amtool() -> str:
    found = os.environ.get("AMTOOL") or shutil.which("amtool")
    if not found:
        pytest.skip("amtool not installed (.ci/run installs it)")
    return found


def route(labels: dict[str, str]) -> str:
    r = subprocess.run([amtool(), "config", "routes", "test", "--config.file", str(ROOT / "docs" / "alertmanager.yml"),
                        *(f"{k}={v}" for k, v in labels.items())], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_example_alertmanager_config_is_valid() -> None:
    r = subprocess.run([amtool(), "check-config", str(ROOT / "docs" / "alertmanager.yml")], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_the_example_alertmanager_config_pages_each_outage_once() -> None:
    """The mirrors are recorded; pages (error, critical) go to the pager; warnings to chat; the supervisor's own
    alerts through its alertmanager hook page as the hooks' severities say."""
    for rule in rules():
        labels = {k: str(v) for k, v in dict(rule["labels"]).items()}  # type: ignore[call-overload]
        want = "records" if "paged_by" in labels else \
            {"critical": "pager", "error": "pager", "warning": "chat"}.get(labels["severity"], "records")
        assert route({"alertname": str(rule["alert"]), "instance": "gpu-7:9400", **labels}) == want, rule["alert"]
    r = AlertRules(AlertsConfig(page_after_s=60), "gpu-7", started_at=0.0)
    r.on_event(sc("WARMING", "READY"), 0.0)
    r.on_event(sc("READY", "STOPPING"), 1.0)
    (outage,) = r.tick(100.0, 1_700_000_000.0)
    assert route(Alertmanager.labels(outage)) == "pager"
    (warning,) = r.on_event(failed("hang", "no token progress"), 101.0)
    assert route(Alertmanager.labels(warning)) == "chat"
