"""A spare's environment (recovery/sleep_env.py): dev mode, and PyTorch's host-register pinned allocation added to
the allocator settings PyTorch would read, never over the operator's own choice."""

from __future__ import annotations

import pytest
from supervisor.recovery.sleep_env import sleep_mode_env

REG = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"

CASES = [
    # (the engine's environment, what a sleep-mode engine gets over it, why)
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": REG}, "nothing set: PyTorch's first name"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:True,{REG}"}, "the operator's settings kept, ours after"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,"},
     {"PYTORCH_CUDA_ALLOC_CONF": f"max_split_size_mb:512,{REG}"}, "a trailing comma is not a second one"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
     {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{REG}"},
     "only the newer name set: setting the older one would hide it from PyTorch"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:256"},
     {"PYTORCH_CUDA_ALLOC_CONF": REG}, "the first name set to nothing is the one PyTorch's CUDA allocator reads"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}, {},
     "the operator said how to pin: left alone"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True"}, {}, "already on: left alone"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:16"},
     {"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:16,pinned_use_cuda_host_register:True"},
     "the operator's thread count kept"),
    ({"VLLMSUP_SPARE_HOST_REGISTER": "0"}, {}, "turned off in [engine.env]"),
    ({"VLLMSUP_SPARE_HOST_REGISTER": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, {},
     "off: the operator's settings untouched"),
    ({"VLLMSUP_SPARE_HOST_REGISTER": "1"}, {"PYTORCH_CUDA_ALLOC_CONF": REG}, "on, as by default"),
]


@pytest.mark.parametrize(("env", "added", "why"), CASES, ids=[c[2] for c in CASES])
def test_a_sleep_mode_engine_pins_its_sleep_with_host_register_unless_told_otherwise(
        env: dict[str, str], added: dict[str, str], why: str) -> None:
    assert sleep_mode_env(env) == {"VLLM_SERVER_DEV_MODE": "1", **added}, why
