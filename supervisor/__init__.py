"""vllm-supervisor: keeps one vLLM engine alive on a host, without anyone touching it.

This file stays free of code: supervisord (which vLLM installs) ships the same package name, and
whichever of the two installs last owns this file (supervisor/about.py holds the version).
"""
