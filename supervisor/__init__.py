"""vllm-supervisor: keeps one vLLM engine alive on a host, without anyone touching it."""
