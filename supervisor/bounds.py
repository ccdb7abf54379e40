"""Units, and the bounds and graces several parts share: one table, so that each is changed in one place."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30

# A second engine that never served (a precompile's throwaway): SIGTERM, this long, then SIGKILL and this long.
THROWAWAY_STOP_S = 5.0
# A standby interpreter (vLLM imported, nothing on the GPU yet).
STANDBY_STOP_S = 2.0
