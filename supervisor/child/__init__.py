"""Code that runs inside vLLM's own processes: standard library only (vLLM's modules, where
imported, are those of the engine's interpreter), never importing the supervisor; copied
beside the logging config or run by path."""
