"""Lifecycle edges, the state file (atomic, corrupt-tolerant) and the parent's import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from supervisor.engine_states import LEGAL_TRANSITIONS, EngineState, IllegalTransition, check_transition
from supervisor.ops import statefile
from supervisor.profile import Profile

S = EngineState


@pytest.mark.parametrize(("a", "b"), [(S.STOPPED, S.STARTING), (S.STARTING, S.WARMING), (S.WARMING, S.READY),
                                      (S.READY, S.STOPPING), (S.STOPPING, S.BACKOFF), (S.BACKOFF, S.STARTING),
                                      (S.STOPPING, S.FATAL), (S.READY, S.DRAINING), (S.DRAINING, S.STOPPING)])
def test_legal_edges(a: EngineState, b: EngineState) -> None:
    check_transition(a, b)


@pytest.mark.parametrize(("a", "b"), [(S.STOPPED, S.READY), (S.STARTING, S.READY), (S.FATAL, S.STARTING),
                                      (S.BACKOFF, S.READY), (S.WARMING, S.BACKOFF)])
def test_illegal_edges_raise(a: EngineState, b: EngineState) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(a, b)


def test_ready_is_only_reachable_from_warming_or_draining() -> None:
    assert {a for a, outs in LEGAL_TRANSITIONS.items() if S.READY in outs} == {S.WARMING, S.DRAINING}


def test_state_roundtrip(tmp_path: Path) -> None:
    learned = statefile.Learned(Profile(max_num_batched_tokens=4096), {"k": 2}, {"kind": "runtime_oom"}, 3)
    statefile.save(tmp_path, learned)
    back = statefile.load(tmp_path)
    assert back is not None and back.profile == learned.profile and back.rung_failures == {"k": 2}
    assert not list(tmp_path.glob(".state-*"))  # no temp file left behind


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 99}',
                                     '{"version": 1, "profile": {"max_num_seqs": "x"}}',
                                     '{"version": 1, "profile": {"gpu_memory_utilization": 7}}'])
def test_corrupt_state_is_ignored_not_fatal(tmp_path: Path, content: str) -> None:
    (tmp_path / "state.json").write_text(content)
    assert statefile.load(tmp_path) is None


def test_missing_state_is_none(tmp_path: Path) -> None:
    assert statefile.load(tmp_path) is None


def test_parent_side_never_imports_vllm_or_torch() -> None:
    code = ("import json, pkgutil, importlib, sys, supervisor;"
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(supervisor.__path__, 'supervisor.')"
            " if not m.name.endswith('__main__')];"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('vllm','torch')]; print(json.dumps(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


SUPERVISORD_MODULES = {"childutils", "compat", "confecho", "datatypes", "dispatchers", "events", "http",
                       "http_client", "loggers", "medusa", "options", "pidproxy", "poller", "process",
                       "rpcinterface", "scripts", "skel", "socket_manager", "states", "supervisorctl",
                       "supervisord", "templating", "tests", "ui", "web", "xmlrpc"}


def test_module_names_do_not_collide_with_supervisord() -> None:
    """vLLM pulls in supervisord (also import name `supervisor`) via model-hosting-container-standards."""
    top = Path(__file__).parents[2].joinpath("supervisor")
    ours = {p.stem for p in top.glob("*.py")} | {p.name for p in top.iterdir() if (p / "__init__.py").exists()}
    assert not ours & SUPERVISORD_MODULES


COORDINATORS = {"Lifecycle": 15, "Daemon": 15}  # issue 26: they coordinate parts; state belongs in the parts


def test_no_class_in_the_package_passes_300_lines_or_20_instance_attributes() -> None:
    """Size is a smell (docs/design.md): wiring that creeps into a class belongs in the composition root. The two
    coordinators are held to 15 attributes."""
    import ast

    top = Path(__file__).parents[2] / "supervisor"
    too_big = []
    for path in top.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
                     and isinstance(a.value, ast.Name) and a.value.id == "self"}
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > 300 or len(attrs) > COORDINATORS.get(node.name, 20):
                too_big.append(f"{path.relative_to(top)}:{node.name} ({lines} lines, {len(attrs)} attributes)")
    assert too_big == []
