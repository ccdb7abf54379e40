"""One start of vLLM: gates, argv and env, the spawn, /health, warm-up, the serving watch, the
stop; what the engine says comes back as records (a Trigger, a Verdict), never as decisions."""
