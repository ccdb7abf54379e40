"""Units, and the bounds and graces several parts share: one table, so that each is changed in
one place."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30

# A second engine that never served (a precompile's throwaway): SIGTERM, this long, then SIGKILL and
# this long.
THROWAWAY_STOP_S = 5.0
# A standby interpreter (vLLM imported, nothing on the GPU yet).
STANDBY_STOP_S = 2.0
# A planned start that changed the engine's command or environment (a reload) waits while the old
# engine serves for a standby to import under them: at most this long (the H200 imports in 15-45 s),
# then it starts cold.
STANDBY_IMPORT_WAIT_S = 180.0

# What a step's own timeout leaves the watchdog before the supervisor counts the step stuck
# (heartbeat.py): the bounds below are added to the configured timeouts of a start, a warm-up, a
# probe round, a stop, the leftovers'.
STEP_SLACK_S = 10.0
# the GPU gate: NVML polls and the utilization it adapts, past its configured waits
GATE_SLACK_S = 30.0
STACK_DUMP_S = 30.0  # py-spy's dumps of a hung engine's processes
SHORT_SLACK_S = 5.0  # after the dead-engine grace, and after a drain's own bound

# Waking a spare (recovery/spare.py), a step of a start: vLLM's /wake_up, then /health, then the
# canary's answer.
SPARE_WAKE_S = 120.0
# A dead engine's spare, woken while its API server exits by itself: how long the card is read for
# the room to wake it (the EngineCore's memory coming back); after it, the start wakes it.
SPARE_ROOM_WAIT_S = 1.0
SPARE_HEALTH_S = 10.0
SPARE_CANARY_S = 30.0
# What a wake needs free beyond what the spare gave up asleep: it takes back its own allocations, no
# new ones (the start headroom is for a start's CUDA context and activation spikes). Seen on the
# H200: a spare built at the engine's utilization had 0.96 GiB of slack once the engine died beside
# a process that took all but 16 MiB.
SPARE_WAKE_MARGIN = 256 * MIB
SPARE_SLEEP_S = 300.0  # the 9B shape's 17.6 GiB of weights took 18 s to copy out on the H200
