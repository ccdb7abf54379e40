"""vLLM installs supervisord, whose import package is also `supervisor`: both must live in one environment."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def test_installing_both_works_and_uninstalling_either_leaves_the_other_whole(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # Both packages go into the new environment; their dependencies are read from this one (a path line in a
    # .pth file adds the directory alone, not the .pth files in it, so our editable install stays out).
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps-of-the-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [py, "-m", "pip", "install", "-q", "--no-deps"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        # Not from the checkout: its own supervisor/ folder would shadow the installed package.
        return subprocess.run(list(args), capture_output=True, text=True, cwd=tmp_path)

    got = run(*pip, "supervisor")
    if got.returncode != 0:
        pytest.skip(f"supervisord could not be installed from the package registry: {got.stderr[-300:]}")
    assert run(*pip, str(ROOT)).returncode == 0
    both = run(py, "-c", "import supervisor.supervisord, supervisor.cli, supervisor.daemon; print('ok')")
    assert both.stdout.strip() == "ok", both.stderr
    run(py, "-m", "pip", "uninstall", "-q", "-y", "supervisor")
    assert run(str(venv / "bin" / "vllm-supervisor"), "--version").stdout.startswith("vllm-supervisor ")
    run(*pip, "supervisor")
    run(py, "-m", "pip", "uninstall", "-q", "-y", "vllm-supervisor")
    assert run(py, "-c", "import supervisor.supervisord; print('ok')").stdout.strip() == "ok"
