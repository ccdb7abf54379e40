"""vLLM's own compile cache as the record of what is compiled (issue 38, item 3): notes beside vLLM's files."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.host import compile_cache

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-logs"  # real vLLM logs, unedited


def test_the_directory_a_start_uses_is_read_from_vllms_own_line_on_the_h200() -> None:
    lines = (FIXTURES / "h200-vllm0.26-startup-ok.log").read_text().splitlines()
    used = [d for d in map(compile_cache.directory_of, lines) if d]
    assert used and used[0].startswith("<vllm-cache>/torch_compile_cache/") and used[0].endswith("/rank_0_0/backbone")
    assert compile_cache.directory_of("INFO Starting to load model") is None


def test_the_cache_root_is_vllms(tmp_path: Path) -> None:
    assert compile_cache.root({"VLLM_CACHE_ROOT": "/srv/vc", "XDG_CACHE_HOME": "/x"}) == Path("/srv/vc")
    assert compile_cache.root({"XDG_CACHE_HOME": "/var/cache/vllm-supervisor"}) == \
        Path("/var/cache/vllm-supervisor/vllm")
    assert compile_cache.root({"HOME": "/home/vllm"}) == Path("/home/vllm/.cache/vllm")


def test_a_note_is_read_back_only_while_vllms_files_are_there_and_never_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "vllm"
    used = root / "torch_compile_cache" / "e33753fcf3" / "rank_0_0" / "backbone"
    used.mkdir(parents=True)
    assert compile_cache.note(str(used), root, "0.26.0:abc:{}", "--max-num-batched-tokens 8192")
    assert compile_cache.note(str(used), root, "0.26.0:abc:{}", "--max-num-batched-tokens 8192")  # once
    assert compile_cache.note(str(used), root, "0.32.0:abc:{}", "--max-num-batched-tokens 8192")
    assert compile_cache.read(root) == {"0.26.0:abc:{}": ["--max-num-batched-tokens 8192"],
                                        "0.32.0:abc:{}": ["--max-num-batched-tokens 8192"]}
    elsewhere = tmp_path / "elsewhere" / "torch_compile_cache" / "x" / "rank_0_0" / "backbone"
    elsewhere.mkdir(parents=True)
    assert not compile_cache.note(str(elsewhere), root, "v:abc:{}", "k")  # a line naming a path outside the root
    assert not compile_cache.note(str(root / "torch_compile_cache" / "../../etc"), root, "v", "k")
    (used / "..").resolve().rename(root / "torch_compile_cache" / "e33753fcf3" / "gone")  # vLLM's files moved away
    assert compile_cache.read(root) == {}
    bad = root / "torch_compile_cache" / "ff93b766ae"
    (bad / "rank_0_0" / "backbone").mkdir(parents=True)
    (bad / compile_cache.NOTE).write_text("{garbage")
    assert compile_cache.read(root) == {}
    (bad / compile_cache.NOTE).write_text(json.dumps({"v:abc:{}": "not a list"}))
    assert compile_cache.read(root) == {}
    assert compile_cache.read(tmp_path / "nothing") == {}


def test_an_aot_compiles_directory_is_its_hash_not_the_aot_folder_all_rungs_share(tmp_path: Path) -> None:
    """vLLM 0.32's AOT compile keeps every rung under torch_compile_cache/torch_aot_compile/<hash>/rank_0_0/model."""
    root = tmp_path / "vllm"
    rung = root / "torch_compile_cache" / "torch_aot_compile" / ("8b" * 32)
    (rung / "rank_0_0").mkdir(parents=True)
    (rung / "rank_0_0" / "model").write_bytes(b"artifact")
    assert compile_cache.rung_dir(str(rung / "rank_0_0" / "model"), root) == rung.resolve()
    assert compile_cache.rung_dir(str(root / "torch_compile_cache" / "torch_aot_compile"), root) is None
    assert compile_cache.note(str(rung / "rank_0_0"), root, "0.32.0:abc:{}", "--max-num-batched-tokens 2048")
    assert compile_cache.read(root) == {"0.32.0:abc:{}": ["--max-num-batched-tokens 2048"]}


def test_vllm_032s_aot_lines_name_the_directory_too() -> None:
    saved = ("(Worker pid=11920) INFO 12-04 21:04:51 [decorators.py:743] [backbone] saved AOT compiled function to "
             "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/8ba695f0/rank_0_0/model")
    assert compile_cache.directory_of(saved) == "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/8ba695f0/" \
                                                "rank_0_0/model"
    loaded = ("INFO [decorators.py:320] [backbone] Directly load AOT compilation from path "
              "/c/torch_aot_compile/ab/rank_0_0/model")
    assert compile_cache.directory_of(loaded) == "/c/torch_aot_compile/ab/rank_0_0/model"


def test_a_spoiled_cache_is_set_aside_whole_and_its_notes_go_with_it(tmp_path: Path) -> None:
    root = tmp_path / "vllm"
    used = root / "torch_compile_cache" / "cda6da90cb" / "rank_0_0" / "backbone"
    used.mkdir(parents=True)
    (root / "torch_compile_cache" / "torch_aot_compile" / "1c466b" / "rank_0_0").mkdir(parents=True)
    assert compile_cache.note(str(used), root, "0.26.0:abc:{}", "--max-num-batched-tokens 8192")
    moved = compile_cache.set_aside(root, "20261207T013712")
    assert moved == root / "torch_compile_cache.set-aside-20261207T013712"
    assert (moved / "cda6da90cb" / "rank_0_0" / "backbone").is_dir() and (moved / "torch_aot_compile").is_dir()
    assert not (root / "torch_compile_cache").exists() and compile_cache.read(root) == {}
    assert compile_cache.set_aside(root, "20261207T013800") is None  # nothing left to move
