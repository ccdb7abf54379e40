"""The standby imports what the last engine's processes imported (vllm_hook.watch_modules keeps the list,
vllm_standby.import_engine_modules reads it), never a module that starts CUDA. Real processes, no vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from supervisor.child import vllm_hook, vllm_standby
from supervisor.config_file import parse
from supervisor.engine import ipc
from supervisor.host.real import RealHost
from supervisor.recovery.standby import StandbyPool

CHILD_DIR = str(Path(vllm_hook.__file__).parent)

WATCHED = """
import importlib, os, sys, time
sys.path.insert(0, sys.argv[1])
import vllm_hook
vllm_hook.MODULES_TICK_S = 0.02
vllm_hook.watch_modules()  # in the root (its parent is VLLMSUP_PID): nothing kept
importlib.import_module("colorsys")
path = os.environ["VLLMSUP_ENGINE_MODULES"]
pid = os.fork()
if pid == 0:  # an EngineCore forked from the root
    importlib.import_module("wave")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.path.exists(path) and "wave" in open(path).read().split():
            os._exit(0)
        time.sleep(0.02)
    os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_the_engine_processes_keep_the_names_of_their_imports_and_the_root_leaves_its_own_out(tmp_path: Path) -> None:
    path = tmp_path / ipc.ENGINE_MODULES
    env = {**os.environ, vllm_hook.MODULES_ENV: str(path), "VLLMSUP_PID": str(os.getpid())}
    done = subprocess.run([sys.executable, "-c", WATCHED, CHILD_DIR], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    kept = path.read_text().split()
    assert "wave" in kept and "vllm_hook" in kept  # the forked child's, with what it inherited
    assert kept.index("vllm_hook") < kept.index("wave")  # in the order they were imported
    assert not any(n.startswith("__") for n in kept)  # __main__ is no module another process can import


def test_only_modules_another_process_can_import_by_name_are_kept(tmp_path: Path) -> None:
    generated = "cx7cwdfrpmceufc7oegsyjo6lg7ebpcqdhdt6zxkitj6sildj6h6"  # inductor's code, named by its hash
    for name in (generated, f"{generated}.kernel", "torch._inductor.runtime.compile_tasks." + generated,
                 "__triton_launcher", "__mp_main__"):
        assert vllm_hook._GENERATED.search(name), name
    for name in ("vllm.v1.worker.gpu_model_runner", "torch._inductor.codecache", "flash_attn_2_cuda", "triton"):
        assert not vllm_hook._GENERATED.search(name), name

    path = tmp_path / "modules.txt"
    vllm_hook.keep_modules(str(path), ["a", "b"])
    vllm_hook.keep_modules(str(path), ["c", "a", "d"])  # another engine process: only what is new is added
    assert path.read_text().split() == ["a", "b", "c", "d"]
    assert not list(tmp_path.glob("*.tmp"))


def test_the_hook_and_the_standby_name_the_same_list() -> None:
    """Both are copied alone into vLLM's interpreter, so neither imports the other: the names must agree."""
    assert vllm_hook.MODULES_ENV == vllm_standby.MODULES_ENV


ENGINE = """
import json, os, sys
if __name__ == "__main__":
  print(json.dumps({"knob": os.environ.get("FAKE_KNOB"), "other": os.environ.get("OTHER_KNOB"),
                  "imported": [m for m in ("sets_env", "broken", "plain_mod") if m in sys.modules]}))
"""
FAKE_TORCH = "from . import cuda\n"
FAKE_CUDA = """
_initialized = False
def _lazy_init():
    global _initialized
    _initialized = True
def is_initialized():
    return _initialized
"""
ASKS_CUDA = """
import torch
try:
    torch.cuda._lazy_init()  # swallowed, as a module that asks the card's capability at import may do
except Exception:
    pass
"""


def _standby(tmp_path: Path, names: list[str], start_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "engine.py").write_text(ENGINE)
    (tmp_path / "sets_env.py").write_text("import os\nos.environ['FAKE_KNOB'] = 'set-at-import'\n"
                                          "os.environ['OTHER_KNOB'] = 'set-at-import'\n")
    (tmp_path / "broken.py").write_text("raise ImportError('needs a GPU')\n")
    (tmp_path / "plain_mod.py").write_text("X = 1\n")
    (tmp_path / "asks_cuda.py").write_text(ASKS_CUDA)
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (tmp_path / "torch" / "cuda.py").write_text(FAKE_CUDA)
    (tmp_path / "modules.txt").write_text("\n".join(names) + "\n")
    (tmp_path / "standby").mkdir(exist_ok=True)
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}
    env = {**base, vllm_standby.MODULES_ENV: str(tmp_path / "modules.txt"),
           "VLLMSUP_STANDBY_READY": str(tmp_path / "standby" / "imported")}
    message = {"argv": [], "env": {**base, **start_env}}
    return subprocess.run([sys.executable, vllm_standby.__file__, "script", str(tmp_path / "engine.py"), "torch"],
                          input=json.dumps(message) + "\n", env=env, capture_output=True, text=True, timeout=60)


def test_a_standby_imports_the_engines_modules_and_makes_their_environment_changes_again(tmp_path: Path) -> None:
    # The start gives FAKE_KNOB no value, as the standby had none: the import's value stands. OTHER_KNOB the start
    # sets itself, so the import would have seen another value than here: the start's stands.
    done = _standby(tmp_path, ["sets_env", "broken", "plain_mod"], {"OTHER_KNOB": "the-operators"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"knob": "set-at-import", "other": "the-operators",
                                       "imported": ["sets_env", "plain_mod"]}
    record = json.loads((tmp_path / "standby" / vllm_standby.MODULES_DONE).read_text())
    assert record["imported"] == 2 and record["failed"] == 1  # a module that fails here is the engine's to import
    assert record["env"] == ["FAKE_KNOB", "OTHER_KNOB"]
    assert (tmp_path / "standby" / "imported").exists()


def test_a_standby_whose_engine_modules_start_cuda_exits_and_the_next_imports_vllm_alone(tmp_path: Path) -> None:
    """A CUDA context in the API server makes vLLM spawn its EngineCore (all imports again) and holds card memory
    beside the serving engine: such a standby never reports itself ready."""
    done = _standby(tmp_path, ["plain_mod", "asks_cuda"], {})
    assert done.returncode == vllm_standby.EXIT_CUDA, done.stderr
    assert "importing asks_cuda ahead starts CUDA" in done.stderr
    assert not (tmp_path / "standby" / "imported").exists()
    assert (tmp_path / ("modules.txt" + vllm_standby.REFUSED)).read_text().strip() == "asks_cuda"

    done = _standby(tmp_path, ["plain_mod", "asks_cuda"], {})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["imported"] == []
    assert not (tmp_path / "standby" / vllm_standby.MODULES_DONE).exists()


KILLED_WRITING = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import vllm_hook
with open(vllm_hook.copy_path(sys.argv[1], os.getpid()), "w") as f:  # the copy keep_modules renames
    f.write("vllm\\n")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # a throwaway engine killed before its rename
"""


def test_a_half_written_list_is_removed_once_its_writer_is_gone_and_a_live_writers_is_left(tmp_path: Path) -> None:
    path = tmp_path / ipc.ENGINE_MODULES
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITING, str(path), CHILD_DIR], timeout=60)
    assert killed.returncode == -9
    live = Path(vllm_hook.copy_path(str(path), os.getpid()))
    live.write_text("vllm\n")
    assert len(list(tmp_path.glob("*.tmp"))) == 2
    pool = StandbyPool(parse({"engine": {"model": "m"}, "state": {"dir": str(tmp_path)}}), RealHost(),
                       lambda _: None)
    pool.dir = tmp_path
    pool._sweep_module_writes()
    assert list(tmp_path.glob("*.tmp")) == [live]
