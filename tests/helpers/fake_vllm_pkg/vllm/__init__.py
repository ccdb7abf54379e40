"""The stand-in's own `vllm` package: only what the supervisor's standby reaches into (vllm.platforms)."""
