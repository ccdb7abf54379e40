"""Alert hooks: the rules alone, each channel against a local receiver, and sending that never delays."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from supervisor.config import AlertsConfig, HookConfig, read_secret
from supervisor.config_file import parse
from supervisor.engine_states import Failure, FailureKind
from supervisor.event_stream import AlertOutcome, Event, Fatal
from supervisor.ops.alerts.channels import MissingSecret, make_channel
from supervisor.ops.alerts.dispatch import Alerts
from supervisor.ops.alerts.rules import AlertRules

from tests.helpers.events import crash_and_recover, failed, lowered, recovered, sc
from tests.helpers.receivers import Receiver

HUNG = Failure(FailureKind.HANG, "no token progress")


# ---- the rules alone ----------------------------------------------------------------------------------------
def test_rules_turn_a_crash_into_a_restart_warning_and_repeats_into_an_error() -> None:
    rules = AlertRules(AlertsConfig(escalate_after=3, dedup_window_s=0), "gpu-7", started_at=0.0)
    assert rules.on_event(sc("WARMING", "READY"), 0.0) == []
    alerts = []
    for i in range(3):
        for ev in crash_and_recover():
            alerts += rules.on_event(ev, 10.0 + i)
    restarted = [a for a in alerts if a.event == "engine_restarted"]
    assert [a.severity for a in restarted] == ["warning", "warning", "error"]
    assert restarted[0].kind == "runtime_oom" and "CUDA out of memory" in restarted[0].message
    assert "3 restarts in 900s" in restarted[2].message
    recovered = [a for a in alerts if a.event == "recovered"]
    assert recovered and not recovered[0].resolves  # no outage was paged, nothing to resolve


def test_rules_page_an_outage_once_and_readiness_clears_it() -> None:
    rules = AlertRules(AlertsConfig(page_after_s=60), "gpu-7", started_at=0.0)
    rules.on_event(sc("WARMING", "READY"), 5.0)
    rules.on_event(sc("READY", "STOPPING"), 100.0)
    rules.on_event(failed("hang", "no token progress for 60s"), 100.0)
    assert rules.tick(159.0, 1_700_000_000.0) == []
    outage = rules.tick(160.0, 1_700_000_001.0)
    assert [(a.event, a.severity, a.kind, a.clears_on) for a in outage] == [("outage", "error", "hang", "ready")]
    assert rules.tick(500.0, 1_700_000_400.0) == []  # once per outage
    assert rules.cleared(sc("WARMING", "READY")) == ["ready"]
    rec = rules.on_event(recovered("hang", 420.0, at=9.0), 520.0)
    assert rec[0].clears_on is None and not rec[0].resolves  # a notice; the page is resolved by the dispatcher


def test_a_quarantined_request_is_a_warning_naming_its_hash_never_its_text() -> None:
    from supervisor.event_stream import RequestQuarantined

    rules = AlertRules(AlertsConfig(), "gpu-7", 0.0)
    (a,) = rules.on_event(RequestQuarantined(at=1.0, request_hash="sha256:9f2c", prompt_tokens=30001,
                                             evidence="CUDA out of memory twice"), 0.0)
    assert (a.event, a.severity, a.details["request_hash"]) == ("request_quarantined", "warning", "sha256:9f2c")


def test_rules_dedup_repeats_within_the_window_and_fatal_is_critical() -> None:
    rules = AlertRules(AlertsConfig(dedup_window_s=300), "gpu-7", 0.0)
    down = lowered()
    assert len(rules.on_event(down, 0.0)) == 1
    assert rules.on_event(down, 100.0) == []
    assert len(rules.on_event(down, 301.0)) == 1
    fatal = rules.on_event(Fatal(at=1.0, reason="restart budget spent", exit_code=4, failure=HUNG), 1.0)
    assert [(a.event, a.severity, a.kind) for a in fatal] == [("fatal", "critical", "hang")]


# ---- each channel against a local receiver --------------------------------------------------------------------
def one_alert(event: Event | None = None) -> Any:
    rules = AlertRules(AlertsConfig(), "gpu-7", 0.0)
    rules.on_event(failed(), 0.0)
    return rules.on_event(event or sc("STOPPING", "BACKOFF", delay_s=1.0), 0.0)[0]


async def test_webhook_posts_the_alert_as_json(receiver: Callable[..., Receiver]) -> None:
    r = receiver()
    ch = make_channel(HookConfig(type="webhook", url=r.url + "/hook"))
    await ch.send(one_alert())
    await ch.close()
    (req,) = r.requests
    body = req.json()
    assert req.path == "/hook" and req.headers["Content-Type"].startswith("application/json")
    assert body["event"] == "engine_restarted" and body["severity"] == "warning" and body["host"] == "gpu-7"
    assert body["kind"] == "runtime_oom" and "CUDA out of memory" in body["message"]
    assert datetime.datetime.fromisoformat(body["time"].replace("Z", "+00:00")).tzinfo is not None


async def test_pagerduty_triggers_and_resolves_with_one_dedup_key(receiver: Callable[..., Receiver],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    r = receiver(status=202)
    monkeypatch.setenv("PD_ROUTING", "R0UT1NG-KEY")
    rules = AlertRules(AlertsConfig(page_after_s=1), "gpu-7", 0.0)
    rules.on_event(failed("hang", "no token progress"), 0.0)
    (outage,) = rules.tick(5.0, 1_700_000_000.0)
    hook = HookConfig(type="pagerduty", url=r.url + "/v2/enqueue", routing_key_env="PD_ROUTING")
    alerts = Alerts(AlertsConfig(), [(hook, make_channel(hook))], lambda _: None)
    alerts.start()
    alerts.fan_out(outage)
    alerts.on_event(sc("WARMING", "READY"))  # the condition that clears an outage
    await alerts.close()
    trigger, resolve = (x.json() for x in r.requests)
    assert trigger["routing_key"] == "R0UT1NG-KEY" and trigger["event_action"] == "trigger"
    assert trigger["payload"]["severity"] == "error" and trigger["payload"]["source"] == "gpu-7"
    assert trigger["payload"]["summary"].startswith("gpu-7: engine not READY for 5s")
    assert trigger["payload"]["timestamp"] == "2023-11-14T22:13:20.000Z"
    assert trigger["payload"]["custom_details"]["kind"] == "hang"
    assert resolve == {"routing_key": "R0UT1NG-KEY", "dedup_key": trigger["dedup_key"], "event_action": "resolve"}


async def test_twilio_sends_one_form_post_per_number_with_basic_auth(receiver: Callable[..., Receiver],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    r = receiver(status=201)
    monkeypatch.setenv("TW_TOKEN", "s3cret-token")
    ch = make_channel(HookConfig(type="twilio", url=r.url, account_sid="AC123", auth_token_env="TW_TOKEN",
                                 from_="+15550001", to=("+15550002", "+15550003")))
    await ch.send(one_alert(Fatal(at=1.0, reason="restart budget spent", exit_code=4, failure=HUNG)))
    await ch.close()
    assert [x.path for x in r.requests] == ["/2010-04-01/Accounts/AC123/Messages.json"] * 2
    auth = r.requests[0].headers["Authorization"]
    assert base64.b64decode(auth.split()[1]).decode() == "AC123:s3cret-token"
    forms = [urllib.parse.parse_qs(x.body.decode()) for x in r.requests]
    assert [f["To"] for f in forms] == [["+15550002"], ["+15550003"]]
    assert forms[0]["From"] == ["+15550001"] and forms[0]["Body"][0].startswith("[critical] gpu-7: supervisor gave up")


async def test_slack_posts_text_and_blocks(receiver: Callable[..., Receiver]) -> None:
    r = receiver()
    ch = make_channel(HookConfig(type="slack", url=r.url + "/services/T/B/X"))
    await ch.send(one_alert())
    await ch.close()
    body = r.requests[0].json()
    assert body["text"].startswith("[WARNING] gpu-7: engine restarted after runtime_oom")
    assert body["blocks"][0]["type"] == "section"


async def test_command_gets_the_alert_json_on_stdin_and_its_status_counts(tmp_path: Path) -> None:
    out = tmp_path / "got.json"
    script = f"import sys, pathlib; pathlib.Path({str(out)!r}).write_text(sys.stdin.read())"
    await make_channel(HookConfig(type="command", argv=(sys.executable, "-c", script))).send(one_alert())
    assert json.loads(out.read_text())["event"] == "engine_restarted"
    from supervisor.ops.alerts.channels import SendFailed

    with pytest.raises(SendFailed, match="exited with status 3"):
        await make_channel(HookConfig(type="command", argv=(sys.executable, "-c", "raise SystemExit(3)"))
                           ).send(one_alert())
    with pytest.raises(SendFailed, match=r"ran past 0\.2s"):
        await make_channel(HookConfig(type="command", timeout_s=0.2,
                                      argv=(sys.executable, "-c", "import time; time.sleep(30)"))).send(one_alert())


async def test_a_command_hook_never_inherits_the_other_hooks_secrets(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25: the command hook's process inherited the PagerDuty and Twilio secrets."""
    monkeypatch.setenv("PD_KEY", "pd-secret-1234")
    monkeypatch.setenv("TW_TOKEN", "tw-secret-5678")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("HARMLESS", "kept")
    out = tmp_path / "env.json"
    script = f"import os, json, pathlib; pathlib.Path({str(out)!r}).write_text(json.dumps(dict(os.environ)))"
    cfg = parse({"alerts": {"hooks": [
        {"type": "pagerduty", "routing_key_env": "PD_KEY"},
        {"type": "twilio", "account_sid": "AC1", "from": "+15550000000", "to": ["+15551111111"],
         "auth_token_env": "TW_TOKEN"},
        {"type": "command", "argv": [sys.executable, "-c", script]}]},
        "engine": {"model": "m"}}).alerts
    alerts = Alerts.from_config(cfg, lambda e: None)
    command = next(h.channel for h in alerts.hooks if h.hook.type == "command")
    await command.send(one_alert())
    env = json.loads(out.read_text())
    assert env.get("HARMLESS") == "kept"
    assert not {"PD_KEY", "TW_TOKEN", "CREDENTIALS_DIRECTORY"} & set(env)
    assert "pd-secret-1234" not in json.dumps(env) and "tw-secret-5678" not in json.dumps(env)


def test_secrets_come_from_the_environment_or_systemd_credentials(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PD_KEY", raising=False)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    with pytest.raises(MissingSecret, match=r"routing_key_env: \$PD_KEY is not set"):
        make_channel(HookConfig(type="pagerduty", routing_key_env="PD_KEY"))
    (tmp_path / "PD_KEY").write_text("from-credentials\n")
    assert read_secret("PD_KEY") == "from-credentials"


def test_a_secret_written_in_the_toml_is_refused_with_a_hint() -> None:
    from supervisor.config import ConfigError

    with pytest.raises(ConfigError, match="secrets are read from the environment"):
        parse({"engine": {"model": "m"}, "alerts": {"hooks": [{"type": "pagerduty", "routing_key": "abc"}]}})


# ---- dispatch: never delays, retries capped, rate limit ----------------------------------------------------
async def test_a_hanging_hook_and_a_failing_hook_never_hold_up_the_others(receiver: Callable[..., Receiver]) -> None:
    hang, bad, good = receiver(hang=True), receiver(status=500), receiver()
    outcomes: list[AlertOutcome] = []
    hooks = [HookConfig(type="webhook", url=hang.url, timeout_s=30),
             HookConfig(type="webhook", url=bad.url, attempts=3, retry_for_s=5),
             HookConfig(type="slack", url=good.url, min_severity="info")]
    alerts = Alerts(AlertsConfig(flush_s=0.5), [(h, make_channel(h)) for h in hooks],
                    lambda ev: outcomes.append(ev) if isinstance(ev, AlertOutcome) else None, retry_wait_s=0.01)
    alerts.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for ev in crash_and_recover():
        alerts.on_event(ev)  # what the bus does: returns at once
    assert loop.time() - t0 < 0.05
    while not (len(good.requests) == 2 and len([o for o in outcomes if o.outcome == "failed"]) == 2):
        await asyncio.sleep(0.01)  # the test's own timeout bounds this
    assert [x.json()["text"].split("]")[0] for x in good.requests] == ["[WARNING", "[INFO"]
    assert len(bad.requests) == 6  # two alerts x three attempts, then given up
    t1 = loop.time()
    await alerts.close()  # bounded by flush_s although one hook hangs
    assert loop.time() - t1 < 0.5 + 1.0
    assert [o.outcome for o in outcomes if o.channel == "webhook" and o.outcome == "failed"] == ["failed"] * 2


async def test_a_hooks_rate_limit_holds_back_all_but_critical(receiver: Callable[..., Receiver]) -> None:
    r = receiver()
    outcomes: list[str] = []
    hook = HookConfig(type="webhook", url=r.url, max_per_hour=2)
    alerts = Alerts(AlertsConfig(dedup_window_s=0), [(hook, make_channel(hook))],
                    lambda ev: outcomes.append(ev.outcome) if isinstance(ev, AlertOutcome) else None, retry_wait_s=0.01)
    alerts.start()
    for ev in [failed(), sc("STOPPING", "BACKOFF")] * 3:
        alerts.on_event(ev)
    alerts.on_event(Fatal(at=1.0, reason="budget", exit_code=4, failure=None))
    await alerts.close()
    assert outcomes.count("suppressed") == 1 and outcomes.count("sent") == 3
    assert "fatal" in [req.json()["event"] for req in r.requests]  # critical: past the limit, in its own lane


async def test_a_command_hook_that_times_out_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    """Issue 16, item 13: a command hook that timed out left its children running."""
    import os
    import time

    pidfile = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    hook = HookConfig(type="command", timeout_s=3.0, argv=(sys.executable, "-c", script))
    with pytest.raises(Exception, match="ran past"):
        await make_channel(hook).send(one_alert())
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # SIGKILL is delivered at once; its reaping by init may take a moment
        try:
            os.kill(grandchild, 0)
            if Path(f"/proc/{grandchild}/stat").read_text().rpartition(")")[2].split()[0] == "Z":  # noqa: ASYNC240
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        await asyncio.sleep(0.05)
    else:
        os.kill(grandchild, 9)
        raise AssertionError("the hook's grandchild outlived the hook's timeout")


# ---- receivers' rules, the page that matters first, pages that resolve --------------------------------------
async def test_a_429_is_retried_after_its_retry_after_and_a_400_is_never_retried(
        receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18, item 2: PagerDuty's 429 + Retry-After: 7 was retried after 0.65 s; a Slack 400 twice more."""
    monkeypatch.setenv("PD_ROUTING", "rk")
    pd = receiver(answer=lambda req: (429, {"Retry-After": "2"}) if len(pd.requests) == 1 else (202, {}))
    slack = receiver(status=400)
    hooks = [HookConfig(type="pagerduty", url=pd.url, routing_key_env="PD_ROUTING", min_severity="warning"),
             HookConfig(type="slack", url=slack.url, min_severity="warning")]
    outcomes: list[AlertOutcome] = []
    alerts = Alerts(AlertsConfig(flush_s=10), [(h, make_channel(h)) for h in hooks],
                    lambda ev: outcomes.append(ev) if isinstance(ev, AlertOutcome) else None, retry_wait_s=0.01)
    alerts.start()
    alerts.fan_out(one_alert())
    await alerts.close()
    assert len(pd.requests) == 2 and pd.requests[1].at - pd.requests[0].at >= 1.9  # waited as it asked
    assert len(slack.requests) == 1  # a 400 says the payload is wrong: trying again cannot help
    assert {(o.channel, o.outcome) for o in outcomes} == {("pagerduty", "sent"), ("slack", "failed")}


async def test_twilio_retries_only_the_numbers_that_did_not_get_the_text(
        receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18, item 2: a later number failing re-texted the numbers that already had the SMS."""
    monkeypatch.setenv("TW_TOKEN", "tok")
    tries: dict[str, int] = {}

    def answer(req: Any) -> tuple[int, dict[str, str]]:
        to = urllib.parse.parse_qs(req.body.decode())["To"][0]
        tries[to] = tries.get(to, 0) + 1
        if to == "+15550003":
            return 400, {}  # Twilio: not a valid phone number, never worth a retry
        return (503, {}) if to == "+15550002" and tries[to] == 1 else (201, {})

    tw = receiver(answer=answer)
    hook = HookConfig(type="twilio", url=tw.url, account_sid="AC1", auth_token_env="TW_TOKEN", from_="+15550000",
                      to=("+15550001", "+15550002", "+15550003"), min_severity="warning")
    outcomes: list[AlertOutcome] = []
    alerts = Alerts(AlertsConfig(flush_s=10), [(hook, make_channel(hook))],
                    lambda ev: outcomes.append(ev) if isinstance(ev, AlertOutcome) else None, retry_wait_s=0.01)
    alerts.start()
    alerts.fan_out(one_alert())
    await alerts.close()
    assert tries == {"+15550001": 1, "+15550002": 2, "+15550003": 1}
    assert [o.outcome for o in outcomes] == ["failed"] and "refused 1 of 3" in outcomes[0].error


async def test_a_fatal_goes_ahead_of_a_hook_busy_retrying_and_what_is_dropped_at_exit_is_logged(
        receiver: Callable[..., Receiver]) -> None:
    """Issue 18, item 3: with a hanging hook and a crash loop, the fatal alert never left and was dropped silently."""
    from structlog.testing import capture_logs

    hang, good = receiver(hang=True), receiver()
    hooks = [HookConfig(type="slack", url=hang.url, min_severity="info", timeout_s=30.0),
             HookConfig(type="webhook", url=good.url, min_severity="info")]
    alerts = Alerts(AlertsConfig(flush_s=1.0, dedup_window_s=0), [(h, make_channel(h)) for h in hooks],
                    lambda _: None, retry_wait_s=0.01)
    alerts.start()
    for ev in [failed(), sc("STOPPING", "BACKOFF", delay_s=1.0)] * 3:  # a crash loop: warnings, then errors
        alerts.on_event(ev)
    alerts.on_event(Fatal(at=1.0, reason="restart budget spent", exit_code=4, failure=None))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0  # the hung hook's timeout is 30 s: the fatal must not wait for it
    while "fatal" not in [r.json()["event"] for r in good.requests] and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert "fatal" in [r.json()["event"] for r in good.requests]
    # The hung hook is stuck on the first warning; its critical lane still tried the fatal at once.
    while not any(b"*fatal*" in r.body for r in hang.requests) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert any(b"*fatal*" in r.body for r in hang.requests), [r.body[:80] for r in hang.requests]
    with capture_logs() as logs:
        await alerts.close()
    dropped = [e for e in logs if e["event"] == "alert.outcome" and e["outcome"] == "dropped"]
    assert {e["channel"] for e in dropped} == {"slack"} and "fatal" in {e["alert"] for e in dropped}


async def test_a_page_left_open_by_a_supervisor_that_died_is_resolved_by_the_next_one(
        receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 18, item 1: open pages lived in memory only; a profile_lowered page had a fixed key and no resolve."""
    monkeypatch.setenv("PD_ROUTING", "rk")
    pd = receiver(status=202)
    hook = HookConfig(type="pagerduty", url=pd.url, routing_key_env="PD_ROUTING", min_severity="warning")
    from tests.helpers.events import P

    first = Alerts(AlertsConfig(dedup_window_s=0), [(hook, make_channel(hook))], lambda _: None,
                   state_dir=str(tmp_path), configured=P)
    first.start()
    first.on_event(Fatal(at=1.0, reason="restart budget spent", exit_code=4, failure=None))
    first.on_event(lowered())
    await first.close()  # the supervisor exits FATAL with two pages open
    (pages,) = json.loads((tmp_path / "pages.json").read_text())["open"].values()
    assert {v["event"] for v in pages.values()} == {"fatal", "profile_lowered"}
    assert (tmp_path / "pages.json").stat().st_mode & 0o777 == 0o600
    second = Alerts(AlertsConfig(), [(hook, make_channel(hook))], lambda _: None, state_dir=str(tmp_path),
                    configured=P)
    second.start()
    second.on_event(sc("WARMING", "READY", profile=P))  # READY at the configured profile: both conditions over
    await second.close()
    sent = [r.json() for r in pd.requests]
    triggers = {s["dedup_key"] for s in sent if s["event_action"] == "trigger"}
    resolves = {s["dedup_key"] for s in sent if s["event_action"] == "resolve"}
    assert len(triggers) == 2 and resolves == triggers
    assert json.loads((tmp_path / "pages.json").read_text())["open"] == {}
    # Notify-only alerts never open a page nobody could resolve.
    from supervisor.event_stream import RequestQuarantined

    third = Alerts(AlertsConfig(), [(hook, make_channel(hook))], lambda _: None, state_dir=str(tmp_path))
    third.start()
    third.on_event(RequestQuarantined(at=1.0, request_hash="h", prompt_tokens=9, evidence="x"))
    await third.close()
    assert len(pd.requests) == 4


def test_the_profile_condition_ends_at_ready_back_at_the_configured_profile_by_any_path() -> None:
    """Issue 28, item 2: a climb, `reset-profile` or a reload that lowers [profile] all end the lowered page."""
    from supervisor.event_stream import Reloaded

    from tests.helpers.events import P2, P

    rules = AlertRules(AlertsConfig(), "gpu-7", 0.0, configured=P)
    assert rules.cleared(sc("WARMING", "READY", profile=P2)) == ["ready"]
    # The climb's rung: the lowering made enable_chunked_prefill and an unset knob explicit; still back.
    climbed = P.with_(enable_chunked_prefill=True)
    assert rules.cleared(sc("WARMING", "READY", profile=climbed)) == ["ready", "profile"]
    # A reload that lowers [profile] to where the engine runs ends it too, without a restart.
    assert rules.cleared(sc("WARMING", "READY", profile=P2)) == ["ready"]
    assert rules.cleared(Reloaded(at=5.0, changed=("profile",), engine_restart=True,
                                  configured_profile=P2)) == ["reload", "profile"]
    # Below the configured profile on any knob: not over.
    low = P.with_(max_num_seqs=8)
    assert not low.reaches(P) and climbed.reaches(P) and P.with_(max_model_len=None).reaches(P)


async def test_a_refused_reload_page_resolves_when_a_supervisor_starts_on_a_good_file(
        receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 28, item 2: the operator fixes the file and restarts the service instead of reloading it."""
    from supervisor.event_stream import ReloadFailed, SupervisorStarted

    from tests.helpers.events import P

    monkeypatch.setenv("PD_ROUTING", "rk")
    pd = receiver(status=202)
    hook = HookConfig(type="pagerduty", url=pd.url, routing_key_env="PD_ROUTING", min_severity="warning")
    first = Alerts(AlertsConfig(), [(hook, make_channel(hook))], lambda _: None, state_dir=str(tmp_path))
    first.start()
    first.on_event(ReloadFailed(at=1.0, error="gateway.listen: must be HOST:PORT"))
    await first.close()
    second = Alerts(AlertsConfig(), [(hook, make_channel(hook))], lambda _: None, state_dir=str(tmp_path))
    second.start()
    second.on_event(SupervisorStarted(at=2.0, admin="127.0.0.1:8001", engine="http://127.0.0.1:18000", profile=P,
                                      state_dir=str(tmp_path)))
    await second.close()
    trigger, resolve = (r.json() for r in pd.requests)
    assert trigger["event_action"] == "trigger" and trigger["payload"]["class"] == "config_reload_failed"
    assert resolve["event_action"] == "resolve" and resolve["dedup_key"] == trigger["dedup_key"]
