"""Issue 38, item 4: whether a start runs vLLM's torch.compile is one pure decision (decide/compile_mode.py), tested
as a table; and what a start without it is given on its command line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from supervisor.config import EngineConfig
from supervisor.decide.compile_mode import UNCOMPILED, StartKind, choose, failure_of
from supervisor.engine.launch import build_argv
from supervisor.engine_states import Failure, FailureKind
from supervisor.profile import Profile

FIRST, PLANNED, FAILED = StartKind.FIRST, StartKind.PLANNED, StartKind.AFTER_FAILURE

# (setting, kind, served, [engine.args], [engine.env], vLLM version, compiled, a word of the why)
CASES: list[tuple[str, StartKind, bool, dict[str, Any], dict[str, str], str | None, bool, str]] = [
    # the only start without it: a served engine's failure, at the shipped default
    ("auto", FAILED, True, {}, {}, "0.26.0", False, "without torch.compile"),
    ("auto", FAILED, True, {"max_num_seqs": 16}, {"HF_HUB_OFFLINE": "1"}, "0.32.0", False, "without"),
    ("auto", FAILED, True, {}, {}, None, False, "without"),  # no version reported: the fallback below holds
    ("auto", FAILED, True, {}, {"TORCH_COMPILE_DISABLE": "0"}, "0.26.0", False, "without"),
    # every start the user waits for knowing it compiles as configured
    ("auto", FIRST, False, {}, {}, None, True, "first start"),
    ("auto", PLANNED, True, {}, {}, "0.26.0", True, "planned"),
    ("auto", PLANNED, False, {}, {}, "0.26.0", True, "planned"),
    # a start that failed before it was READY: the next one compiles (one without torch.compile may be what failed)
    ("auto", FAILED, False, {}, {}, "0.26.0", True, "before it served"),
    # the operator's word
    ("off", FAILED, True, {}, {}, "0.26.0", True, "uncompiled_restart"),
    ("auto", FAILED, True, {"compilation_config": {"mode": 3}}, {}, "0.26.0", True, "compilation_config"),
    ("auto", FAILED, True, {"enforce_eager": True}, {}, "0.26.0", True, "enforce_eager"),
    ("auto", FAILED, True, {"enforce-eager": True}, {}, "0.26.0", True, "enforce_eager"),
    ("auto", FAILED, True, {"O": 2}, {}, "0.26.0", True, "[engine.args] O"),
    ("auto", FAILED, True, {"optimization_level": 0}, {}, "0.26.0", True, "optimization_level"),
    ("auto", FAILED, True, {}, {"TORCH_COMPILE_DISABLE": "1"}, "0.26.0", True, "TORCH_COMPILE_DISABLE"),
    ("auto", FAILED, True, {}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, "0.26.0", True, "BREAKABLE"),
    # a vLLM whose compilation_config has no mode or cudagraph_mode
    ("auto", FAILED, True, {}, {}, "0.10.2", True, "predates"),
    ("auto", FAILED, True, {}, {}, "0.11.0rc1+cpu", False, "without"),
    ("auto", FAILED, True, {}, {}, "1.0.0", False, "without"),
]


@pytest.mark.parametrize(("setting", "kind", "served", "args", "env", "version", "compiled", "word"), CASES)
def test_how_a_start_compiles(setting: str, kind: StartKind, served: bool, args: dict[str, Any],
                              env: dict[str, str], version: str | None, compiled: bool, word: str) -> None:
    got = choose(setting, kind, served=served, args=args, env=env, version=version)
    assert got.compiled is compiled
    assert word in got.why


def test_a_configuration_error_of_a_start_without_torch_compile_is_restarted_not_fatal() -> None:
    refused = Failure(FailureKind.CONFIG_ERROR, "error: argument --compilation-config/-O: 1 validation error")
    got = failure_of(refused, compiled=False)
    assert got.kind is FailureKind.ENGINE_DEAD and refused.evidence in got.evidence
    # the operator's own configuration error stays one; nothing else changes
    assert failure_of(refused, compiled=True) is refused
    oom = Failure(FailureKind.RUNTIME_OOM, "CUDA out of memory")
    assert failure_of(oom, compiled=False) is oom


def test_a_start_without_torch_compile_gets_compilation_config_mode_0_with_full_cuda_graphs() -> None:
    engine = EngineConfig(model="/m", args={"max_num_seqs": 8})
    compiled = build_argv(engine, Profile(max_num_batched_tokens=2048))
    assert "--compilation-config" not in compiled
    argv = build_argv(engine, Profile(max_num_batched_tokens=2048), compiled=False)
    assert argv[:len(compiled)] == compiled
    flag = argv.index("--compilation-config")
    assert json.loads(argv[flag + 1]) == UNCOMPILED == {"mode": 0, "cudagraph_mode": "FULL"}


def test_vllm_supervisor_status_says_the_engine_runs_without_torch_compile() -> None:
    from supervisor.ops import oncall

    doc = {"state": "READY", "ready": True, "state_for_s": 5, "engine_pid": 7, "profile": {}, "restarts": 1}
    assert "without torch.compile" not in oncall.render_status(
        {**doc, "compile": {"compiled": True, "why": "compiled as configured"}})
    assert "without torch.compile" not in oncall.render_status({**doc, "compile": None})
    text = oncall.render_status({**doc, "compile": {"compiled": False, "why": "without torch.compile (...)"}})
    assert "engine    pid 7" in text and "[without torch.compile: a failure's restart" in text
