"""`vllm-supervisor doctor` against the installed vLLM's own serve parser (issue 28, item 6)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import free_port, to_toml
from tests.helpers.real import REAL_BASE, TINY_MODEL, VLLM_PYTHON

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="set VLLM_PYTHON and TINY_MODEL (make test-real)"),
]


def doctor(tmp_path: Path, args: dict[str, Any], command: list[str] | None = None) -> dict[str, Any]:
    doc = copy.deepcopy(REAL_BASE)
    doc["engine"]["args"].update(args)
    if command:
        doc["engine"]["command"] = command
    doc["engine"]["port"] = free_port()
    doc["engine"]["args"]["api_key"] = "sk-doctor-s3cr3t"
    doc["state"] = {"dir": str(tmp_path / "state")}
    doc["admin"] = {"listen": f"127.0.0.1:{free_port()}"}
    path = tmp_path / "config.toml"
    path.write_text(to_toml(doc))
    r = subprocess.run([sys.executable, "-m", "supervisor", "doctor", "--cpu", "--json", "--config", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert "sk-doctor-s3cr3t" not in r.stdout + r.stderr
    found: dict[str, Any] = json.loads(r.stdout)
    found["rc"] = r.returncode
    found["engine_args"] = next(f for f in found["findings"] if f["check"] == "engine_args")
    return found


def test_doctor_reads_the_engine_arguments_with_vllms_own_parser(tmp_path: Path) -> None:
    good = doctor(tmp_path, {})
    assert good["engine_args"]["level"] == "ok" and good["rc"] == 0, good
    bad = doctor(tmp_path, {"no_such_flag": 1})
    assert bad["rc"] == 1 and bad["engine_args"]["level"] == "fail"
    assert "--no-such-flag" in bad["engine_args"]["message"], bad["engine_args"]


def test_doctor_reads_a_vllm_serve_command_through_its_scripts_interpreter(tmp_path: Path) -> None:
    serve = [str(Path(VLLM_PYTHON).parent / "vllm"), "serve"]  # the README's form
    assert doctor(tmp_path, {}, serve)["engine_args"]["level"] == "ok"
    bad = doctor(tmp_path, {"max_loras": "many"}, serve)["engine_args"]
    assert bad["level"] == "fail" and "--max-loras" in bad["message"] and "many" in bad["message"], bad


def test_what_check_refuses_as_a_managed_knob_is_what_vllms_own_parser_reads_as_one() -> None:
    """Issue 39: the parent never imports vLLM, so `check` refuses by the prefix rule (config.managed_knob_of); here
    the installed vLLM's serve parser reads each refused key, and a key next to them, to show the rule is its own."""
    from supervisor.config import MANAGED_FLAGS, managed_knob_of

    keys = ["max_num_seq", "max_num_seqs", "max-num-batched", "gpu_memory_util", "gpu_mem", "max_model",
            "no_enable_chunked", "enable_chunked", "max_num_partial_prefills", "max_loras", "enable_prefix_caching"]
    script = """
import json, sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
managed, keys = json.loads(sys.stdin.read())
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
flags = sorted(o for a in parser._actions for o in a.option_strings)
default = vars(parser.parse_args([]))
out = {"prefixes": [o for o in flags for m in managed
                    for f in ("--" + m.replace("_", "-"), "--no-" + m.replace("_", "-")) if f.startswith(o) and f != o]}
for key in keys:
    flag = "--" + key.replace("_", "-")
    for argv in ([flag, "7"], [flag]):  # a value, or a switch
        try:
            got = vars(parser.parse_args(argv))
            break
        except SystemExit:
            got = default
    changed = [m for m in managed if got.get(m) != default.get(m)]
    out[key] = changed[0] if changed else None
print(json.dumps(out))
"""
    r = subprocess.run([VLLM_PYTHON, "-c", script], input=json.dumps([list(MANAGED_FLAGS), keys]),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    read = json.loads(r.stdout.strip().splitlines()[-1])
    assert read.pop("prefixes") == []  # no vLLM option is itself a prefix of a managed knob's flag
    for key in keys:
        assert read[key] == managed_knob_of(key), (key, read[key])
