"""The engine's console in the journal (issue 39): vLLM's ERROR lines filed at priority err, the rest as before."""

from __future__ import annotations

from collections.abc import Callable

from tests.helpers.processes import Sup, send_long_prompt


def test_under_journald_vllms_error_lines_carry_the_err_priority(supervise: Callable[..., Sup]) -> None:
    """On the old code every vLLM line reached the journal at the unit's level: `journalctl -p err` showed no
    CUDA out of memory."""
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}}, env={"JOURNAL_STREAM": "8:12345"})
    sup.wait_ready()
    assert send_long_prompt(sup) == 500
    sup.wait_ready(restarts=1)
    lines = sup.log_path.read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("<3>")]
    assert any("out of memory" in line.lower() for line in errors), lines[-40:]
    assert all(" ERROR " in line for line in errors)
    assert any(" INFO " in line and not line.startswith("<") for line in lines)  # the rest at the unit's level
    assert not any(line.startswith("<{") for line in lines)  # the supervisor's own JSON events as they were
