"""vLLM installs supervisord, whose import package is also `supervisor`: both must live in one environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_installing_both_works_and_uninstalling_either_leaves_the_other_whole(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, pip = str(venv / "bin" / "python"), [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        # Not from the checkout: its own supervisor/ folder would shadow the installed package.
        return subprocess.run(list(args), capture_output=True, text=True, cwd=tmp_path)

    got = run(*pip, "supervisor")
    if got.returncode != 0:
        pytest.skip(f"supervisord could not be installed from the package registry: {got.stderr[-300:]}")
    assert run(*pip, str(ROOT)).returncode == 0
    both = run(py, "-c", "import supervisor.supervisord, supervisor.cli, supervisor.arbiter; print('ok')")
    assert both.stdout.strip() == "ok", both.stderr
    run(py, "-m", "pip", "uninstall", "-q", "-y", "supervisor")
    assert run(str(venv / "bin" / "vllm-supervisor"), "--version").stdout.startswith("vllm-supervisor ")
    run(*pip, "supervisor")
    run(py, "-m", "pip", "uninstall", "-q", "-y", "vllm-supervisor")
    assert run(py, "-c", "import supervisor.supervisord; print('ok')").stdout.strip() == "ok"
