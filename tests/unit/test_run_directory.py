"""The run directory's paths fit AF_UNIX: an events socket that cannot be bound leaves its engine unheard."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from supervisor.engine import ipc
from supervisor.host import rundir
from supervisor.profile import Profile
from supervisor.recovery.throwaway import work_name

EVERY_FLAG = Profile(max_num_batched_tokens=131072, max_num_seqs=1024, gpu_memory_utilization=0.93,
                     max_model_len=1048576, enable_chunked_prefill=False)


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_a_second_engines_socket_fits_under_the_units_runtime_directory(
        sleep_mode: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the template unit's /run/vllm-supervisor-<instance>/ a precompile's socket, named by its rung's flags,
    was 115 bytes: it could not be bound, and the standby a first start makes never learned what vLLM set."""
    inside = f"/{work_name(EVERY_FLAG, sleep_mode)}/{ipc.SOCKET_NAME}"
    assert len(inside) <= rundir.LONGEST_INSIDE
    unit = "/run/vllm-supervisor-gpu0"
    made = Path(unit) / "vllm-supervisor-4194304-abcdefgh"
    assert len(f"{made}{inside}") <= rundir.SOCKET_PATH_MAX
    monkeypatch.setenv("RUNTIME_DIRECTORY", unit)
    assert rundir.parent() == Path(unit)


def test_two_rungs_get_two_directories() -> None:
    assert work_name(EVERY_FLAG, False) != work_name(EVERY_FLAG.with_(max_num_batched_tokens=6144), False)
    assert work_name(EVERY_FLAG, False) != work_name(EVERY_FLAG, True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="vsr-", dir="/tmp"))  # pytest's tmp_path is itself too deep
    yield where
    shutil.rmtree(where, ignore_errors=True)


def test_a_runtime_directory_too_deep_for_the_sockets_is_passed_over_for_the_temporary_one(
        monkeypatch: pytest.MonkeyPatch, short_dir: Path) -> None:
    deep = short_dir / ("d" * 60)
    deep.mkdir()
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(deep))
    monkeypatch.setattr(rundir.tempfile, "gettempdir", lambda: str(short_dir))
    made = rundir.make()
    assert made.parent == short_dir
    assert len(str(made)) + rundir.LONGEST_INSIDE <= rundir.SOCKET_PATH_MAX
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{short_dir}:{deep}")  # RuntimeDirectory= with several: the first
    assert rundir.parent() == short_dir
