"""One class per alert service behind one small protocol: ``await channel.send(alert)`` raises on
failure.

Secrets (PagerDuty routing key, Twilio auth token) are read from the environment or from systemd's
``$CREDENTIALS_DIRECTORY``, never from the TOML, and never appear in a log line or an error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import hmac
import json
import os
import signal
import time
from typing import Protocol

import aiohttp

from supervisor.config import HookConfig, read_secret
from supervisor.ops.alerts.rules import Alert, rfc3339

PD_SEVERITY = {"info": "info", "warning": "warning", "error": "error", "critical": "critical"}


class SendFailed(RuntimeError):
    """The service did not take the alert (an error status, a timeout, a command that failed).

    ``retryable``: trying again may help (5xx, 408, 429, no answer); any other 4xx says the
    request itself is wrong. ``retry_after``: the seconds the service asked for (its
    Retry-After), when it said."""

    def __init__(self, message: str, retryable: bool = True,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable, self.retry_after = retryable, retry_after


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """An HTTP Retry-After (seconds, or an HTTP date) in seconds from now; None when absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


class Channel(Protocol):
    name: str

    async def send(self, alert: Alert) -> None: ...

    async def close(self) -> None: ...


class MissingSecret(ValueError):
    def __init__(self, field: str, name: str) -> None:
        super().__init__(f"{field}: ${name} is not set and no systemd credential {name!r} exists")
        self.field = field


class _Http:
    """A lazily opened aiohttp session with the hook's timeout."""

    def __init__(self, hook: HookConfig) -> None:
        self.hook = hook
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=self.hook.timeout_s))
        return self._session

    async def post(self, url: str, what: str, **kw: object) -> None:
        try:
            async with self.session().post(url, **kw) as r:  # type: ignore[arg-type]
                if r.status >= 300:
                    raise SendFailed(f"{what} answered HTTP {r.status}",
                                     retryable=r.status >= 500 or r.status in (408, 429),
                                     retry_after=retry_after_s(r.headers.get("Retry-After")))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise SendFailed(f"{what} failed: {type(exc).__name__}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _secret(hook: HookConfig, key: str) -> str | None:
    """The secret named by ``hook.<key>`` (None when the hook names none); MissingSecret when it
    is not there."""
    name = getattr(hook, key)
    if not name:
        return None
    value = read_secret(name)
    if not value:
        raise MissingSecret(f"alerts.hooks.{key}", name)
    return value


SIGNATURE_HEADER = "X-Vllm-Supervisor-Signature"
TIMESTAMP_HEADER = "X-Vllm-Supervisor-Timestamp"


def signature(key: str, timestamp: str, body: bytes) -> str:
    """HMAC-SHA256 over ``TIMESTAMP.BODY``, as the receiver recomputes it (the timestamp bounds a
    replay)."""
    return "sha256=" + hmac.new(key.encode(),
                                timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class Webhook(_Http):
    """The alert as JSON; with ``auth_header_env`` an Authorization header, with
    ``hmac_secret_env`` a signature."""

    name = "webhook"

    def __init__(self, hook: HookConfig) -> None:
        super().__init__(hook)
        self._authorization = _secret(hook, "auth_header_env")
        self._hmac_key = _secret(hook, "hmac_secret_env")

    async def send(self, alert: Alert) -> None:
        body = json.dumps(alert.as_json()).encode()
        headers = {"Content-Type": "application/json"}
        if self._authorization:
            headers["Authorization"] = self._authorization
        if self._hmac_key:
            stamp = str(int(time.time()))
            headers[TIMESTAMP_HEADER] = stamp
            headers[SIGNATURE_HEADER] = signature(self._hmac_key, stamp, body)
        await self.post(self.hook.endpoint, "webhook", data=body, headers=headers)


def slack_escape(text: str) -> str:
    """Slack's three control characters in message text (its "Escaping text" rules): a client's
    prompt words or an engine's message can never become a link, a mention or markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Slack(_Http):
    name = "slack"

    async def send(self, alert: Alert) -> None:
        host, message = slack_escape(alert.host), slack_escape(alert.message)
        text = f"[{alert.severity.upper()}] {host}: {message}"
        blocks = [{
            "type": "section",
            "text": {"type": "mrkdwn", "text": f"*{alert.event}* on `{host}`\n"
                     f"{message}"}
        }, {
            "type": "context",
            "elements": [{"type": "mrkdwn", "text": f"{alert.severity} · {alert.time}"}]
        }]
        await self.post(self.hook.endpoint, "slack", json={"text": text, "blocks": blocks})


class Alertmanager(_Http):
    """Prometheus Alertmanager's API v2 (``POST /api/v2/alerts``), so its routing, silences and
    inhibition apply.

    Like PagerDuty it gets pages only (alerts with a condition that clears them): each fires
    until resolved, for at most ``PAGE_HOLD_S`` (then Alertmanager resolves it by itself). The
    resolve sends the same labels with ``endsAt`` now: they carry the opening alert's name and
    severity, kept with the open page."""

    name = "alertmanager"
    PAGE_HOLD_S = 24 * 3600.0

    def __init__(self, hook: HookConfig) -> None:
        super().__init__(hook)
        authorization = _secret(hook, "auth_header_env")
        self._headers = {"Authorization": authorization} if authorization else {}

    @staticmethod
    def labels(alert: Alert) -> dict[str, str]:
        """What Alertmanager routes on (docs/alertmanager.yml): a resolve carries the opening
        alert's."""
        opened = alert.details.get("opened_as", {}) if alert.resolves else {}
        labels = {
            "alertname": str(opened.get("event", alert.event)),
            "severity": str(opened.get("severity", alert.severity)), "instance": alert.host,
            "service": "vllm-supervisor", "dedup_key": alert.dedup_key
        }
        if alert.kind:
            labels["kind"] = alert.kind
        return labels

    async def send(self, alert: Alert) -> None:
        opened = alert.details.get("opened_as", {}) if alert.resolves else {}
        ends = alert.at if alert.resolves else alert.at + self.PAGE_HOLD_S
        body = [{
            "labels": self.labels(alert), "annotations": {"summary": alert.message[:1024]},
            "startsAt": rfc3339(float(opened.get("since", alert.at))), "endsAt": rfc3339(ends)
        }]
        await self.post(
            self.hook.endpoint.rstrip("/") + "/api/v2/alerts", "alertmanager", json=body,
            headers=self._headers)


class PagerDuty(_Http):
    """Events API v2: trigger with a stable dedup_key per outage; the recovery resolves it."""

    name = "pagerduty"

    def __init__(self, hook: HookConfig) -> None:
        super().__init__(hook)
        key = read_secret(hook.routing_key_env)
        if not key:
            raise MissingSecret("alerts.hooks.routing_key_env", hook.routing_key_env)
        self._routing_key = key

    async def send(self, alert: Alert) -> None:
        body: dict[str, object] = {"routing_key": self._routing_key, "dedup_key": alert.dedup_key}
        if alert.resolves:
            body["event_action"] = "resolve"
        else:
            body["event_action"] = "trigger"
            body["payload"] = {
                "summary": f"{alert.host}: {alert.message}"[:1024], "source": alert.host,
                "severity": PD_SEVERITY[alert.severity], "timestamp": alert.time,
                "component": "vllm", "group": "vllm-supervisor", "class": alert.event,
                "custom_details": {**alert.details, "kind": alert.kind}
            }
        await self.post(self.hook.endpoint, "pagerduty", json=body)


class Twilio(_Http):
    """SMS through the Messages API: one form POST per number, HTTP basic auth. A retry texts
    only the numbers that did not get the message yet: nobody is texted twice because somebody
    else's number failed."""

    name = "twilio"

    def __init__(self, hook: HookConfig) -> None:
        super().__init__(hook)
        token = read_secret(hook.auth_token_env)
        if not token:
            raise MissingSecret("alerts.hooks.auth_token_env", hook.auth_token_env)
        self._auth = {"Authorization": aiohttp.encode_basic_auth(hook.account_sid, token)}
        self._left: dict[tuple[str, str, float], list[str]] = {}  # alert -> numbers still to text
        # alert -> numbers Twilio refused
        self._refused: dict[tuple[str, str, float], list[SendFailed]] = {}

    async def send(self, alert: Alert) -> None:
        base = self.hook.endpoint.rstrip("/")
        url = f"{base}/2010-04-01/Accounts/{self.hook.account_sid}/Messages.json"
        body = f"[{alert.severity}] {alert.host}: {alert.message}"[:1500]
        key = (alert.event, alert.dedup_key, alert.at)
        left = self._left.setdefault(key, list(self.hook.to))
        while len(self._left) > 100:  # alerts given up on: forget the oldest
            oldest = next(iter(self._left))
            self._left.pop(oldest)
            self._refused.pop(oldest, None)
        refused = self._refused.setdefault(key, [])
        failed: list[SendFailed] = []
        for number in list(left):
            try:
                await self.post(url, "twilio",
                                data={"To": number, "From": self.hook.from_,
                                      "Body": body}, headers=self._auth)
                left.remove(number)
            except SendFailed as exc:
                failed.append(exc)
                # Twilio refused this number (400: not a valid number): never again
                if not exc.retryable:
                    left.remove(number)
                    refused.append(exc)
        retryable = [f for f in failed if f.retryable]
        if not retryable:
            self._left.pop(key, None)
            self._refused.pop(key, None)
            if refused:
                raise SendFailed(
                    f"twilio refused {len(refused)} of {len(self.hook.to)} numbers ({refused[0]})",
                    retryable=False)
            return
        raise SendFailed(
            f"twilio: {len(left)} of {len(self.hook.to)} numbers not texted yet ({retryable[0]})",
            retry_after=max((f.retry_after for f in retryable if f.retry_after), default=None))


class Command:
    """``argv`` run without a shell, the alert JSON on its stdin, bounded by the hook's timeout."""

    name = "command"

    def __init__(self, hook: HookConfig, withheld: tuple[str, ...] = ()) -> None:
        self.hook, self.withheld = hook, withheld

    async def send(self, alert: Alert) -> None:
        # The other hooks' secrets (a PagerDuty routing key, a Twilio token) and systemd's
        # credentials stay ours.
        env = {k: v for k, v in os.environ.items() if k not in self.withheld}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.hook.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True, env=env)
        except OSError as exc:
            raise SendFailed(
                f"command {self.hook.argv[0]!r} could not start: {exc.strerror}") from None
        try:
            await asyncio.wait_for(proc.communicate(json.dumps(alert.as_json()).encode()),
                                   self.hook.timeout_s)
        except TimeoutError:
            # Its own session (start_new_session): whatever it started goes with it, not only the
            # leader.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise SendFailed(
                f"command {self.hook.argv[0]!r} ran past {self.hook.timeout_s:g}s") from None
        if proc.returncode != 0:
            raise SendFailed(f"command {self.hook.argv[0]!r} exited with status {proc.returncode}")

    async def close(self) -> None:
        pass


def make_channel(hook: HookConfig, withheld: tuple[str, ...] = ()) -> Channel:
    """The channel for one hook; raises MissingSecret when its secret cannot be found.
    ``withheld``: variables a command hook's process never inherits (every hook's secret)."""
    if hook.type == "command":
        return Command(hook, withheld)
    kinds: dict[str, type] = {
        "webhook": Webhook, "slack": Slack, "pagerduty": PagerDuty, "twilio": Twilio,
        "alertmanager": Alertmanager
    }
    channel: Channel = kinds[hook.type](hook)
    return channel
