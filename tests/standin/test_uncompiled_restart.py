"""Issue 38, item 4: a served engine's failure restarts without vLLM's torch.compile where no spare is woken, and
every other start compiles as configured (decide/compile_mode.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.ops import control

from tests.helpers.processes import Sup, send_long_prompt

COMPILE_S = 5.0  # the stand-in's compile of a rung its cache lacks: well above a restart's own start on a busy machine


def _compiles(sup: Sup) -> list[str]:
    """The stand-in's own words, one per start: how it compiled (or that it did not)."""
    words = ("Compiling a graph", "Directly load the compiled graph", "Inductor compilation was disabled")
    return [w for line in sup.log_path.read_text().splitlines() for w in words if w in line]


def _compile_flag(spawned: dict[str, Any]) -> dict[str, Any] | None:
    argv = spawned["argv"]
    return json.loads(argv[argv.index("--compilation-config") + 1]) if "--compilation-config" in argv else None


def test_a_served_engines_failure_restarts_without_torch_compile_and_the_next_planned_start_compiles(
        supervise: Callable[..., Sup], tmp_path: Path) -> None:
    """The runtime OOM's restart goes to a rung vLLM's cache lacks: compiled, it would compile that rung on its path
    (COMPILE_S here; 32 s on the H100 shared card of run 13); without torch.compile it compiles nothing and loads
    nothing compiled. The rung is not noted compiled (it was not). A planned restart then compiles it."""
    cache = tmp_path / "vllm-cache"
    sup = supervise({"engine": {"env": {"VLLM_CACHE_ROOT": str(cache), "FAKE_VLLM_COMPILE_S": str(COMPILE_S),
                                        "FAKE_VLLM_OOM_TOKENS": "5000"}}})
    st = sup.wait_ready(30)
    assert st["compile"] == {"compiled": True, "why": "compiled as configured: the supervisor's first start"}
    assert _compiles(sup) == ["Compiling a graph"]

    assert send_long_prompt(sup) == 500  # a runtime OOM of a READY engine: the restart steps down to 6144
    st = sup.wait_ready(30, restarts=1)
    assert st["profile"]["max_num_batched_tokens"] == 6144
    assert st["compile"]["compiled"] is False and "without torch.compile" in st["compile"]["why"], st["compile"]
    spawned = sup.events("engine.spawned")
    assert _compile_flag(spawned[0]) is None
    assert _compile_flag(spawned[1]) == {"mode": 0, "cudagraph_mode": "FULL"}
    assert _compiles(sup) == ["Compiling a graph", "Inductor compilation was disabled"]
    assert st["timings"]["start_to_ready_s"] < COMPILE_S  # it compiled nothing on its path
    compiled = json.loads((sup.state_dir / "compiled.json").read_text())
    assert not any("6144" in key for keys in compiled.values() for key in keys), compiled

    assert control.send(control.path_in(sup.state_dir), "restart")["ok"] is True
    st = sup.wait_for(lambda s: s["ready"] and s["start"] == 3, 30, "the planned restart's READY")
    assert st["compile"] == {"compiled": True, "why": "compiled as configured: a planned start"}
    assert _compile_flag(sup.events("engine.spawned")[2]) is None
    assert _compiles(sup)[-1] == "Compiling a graph"  # the 6144 rung, compiled now
    assert sup.events("engine.failed")[0]["kind"] == "runtime_oom"


def test_a_start_without_torch_compile_that_cannot_start_is_restarted_compiled_not_fatal(
        supervise: Callable[..., Sup]) -> None:
    """A vLLM that refuses compilation_config's keys (before 0.11) exits 2 with argparse's words, which is a
    configuration error and FATAL for the operator's own flags. For the supervisor's it is that start's: the next
    start compiles as configured and serves."""
    sup = supervise({"engine": {"env": {"FAKE_VLLM_COMPILATION_CONFIG_REFUSED": "1", "FAKE_VLLM_OOM_TOKENS": "5000"}}})
    sup.wait_ready(30)
    assert send_long_prompt(sup) == 500
    st = sup.wait_ready(30, restarts=2)
    first, second = sup.events("engine.failed")
    assert first["kind"] == "runtime_oom"
    assert second["kind"] == "engine_dead" and second["phase"] == "loading", second
    assert "--compilation-config" in second["evidence"] and "compiles as configured" in second["evidence"]
    flags = [_compile_flag(e) for e in sup.events("engine.spawned")]
    assert flags == [None, {"mode": 0, "cudagraph_mode": "FULL"}, None]
    assert st["compile"]["compiled"] is True and "failed before it served" in st["compile"]["why"]
    assert st["state"] == "READY" and sup.proc.poll() is None


def test_uncompiled_restart_off_keeps_every_restart_compiled(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}},
                     "recovery": {"uncompiled_restart": "off"}})
    sup.wait_ready(30)
    assert send_long_prompt(sup) == 500
    st = sup.wait_ready(30, restarts=1)
    assert [_compile_flag(e) for e in sup.events("engine.spawned")] == [None, None]
    assert st["compile"]["compiled"] is True and "uncompiled_restart" in st["compile"]["why"]
