"""The shipped units: systemd-analyze verify and security, and the settings on-call relies on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).parents[2] / "systemd"
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze is not installed (.ci/run installs it)")


def staged(tmp_path: Path, name: str, as_name: str | None = None) -> Path:
    """The unit with ExecStart pointing at an executable that exists here (verify checks it)."""
    text = (UNITS / name).read_text().replace("/opt/vllm-supervisor/bin/vllm-supervisor", sys.executable)
    p = tmp_path / (as_name or name)
    p.write_text(text)
    return p


@pytest.mark.parametrize(("name", "as_name"), [("vllm-supervisor.service", None),
                                               ("vllm-supervisor@.service", "vllm-supervisor@gpu0.service")])
def test_units_verify_and_score_under_5(tmp_path: Path, name: str, as_name: str | None) -> None:
    unit = staged(tmp_path, name, as_name)
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    sec = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", sec.stdout + sec.stderr)
    assert m is not None, sec.stdout + sec.stderr
    assert float(m.group(1)) < 5.0


@pytest.mark.parametrize("name", ["vllm-supervisor.service", "vllm-supervisor@.service"])
def test_units_carry_what_on_call_relies_on(name: str) -> None:
    text = (UNITS / name).read_text()
    settings = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify" and settings["OOMPolicy"] == "continue"
    assert set(settings["RestartPreventExitStatus"].split()) == {"2", "3", "6"}
    assert int(settings["TimeoutStopSec"]) > 20 + 10 + 5 + 60 + 10  # the worst stop (see the comment in the unit)
    assert settings["UMask"] == "0027" and "CacheDirectory" in settings
    assert "XDG_CACHE_HOME=%C/vllm-supervisor" in settings["Environment"]


def test_our_log_lines_carry_journald_priorities() -> None:
    code = ("from supervisor.ops import logs; import structlog; logs.configure('json', 'info');"
            "l = structlog.get_logger(); l.info('a.b', x=1); l.warning('engine.failed', kind='hang'); l.error('c.d')")
    env = {"JOURNAL_STREAM": "8:1234", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert [line[:3] for line in out.splitlines()] == ["<6>", "<4>", "<3>"]
    assert '"event": "engine.failed"' in out.splitlines()[1]
