"""A second engine (a precompile's throwaway, a spare being built) that died before /health of a
spoiled compile cache (classify.py's ``COMPILE_CACHE_PATTERNS`` in its own output): whether the
cache is moved aside now, and whether its death is held against its rung. Or of its port taken
(``PORT_TAKEN_PATTERNS``): the port it was given is any the kernel had free a moment before, and
anything on the host may take it before vLLM binds it (its imports, 20-30 s on a GPU host); that is
not the rung's, and it is started again on another port, up to ``PORT_TAKEN_TRIES`` times a rung.

The engine's own ``compile_cache`` death is the policy's (policy.py). A second engine dies of the
same cache first wherever a start builds ahead (its rungs compiled first, its spare built first):
moving the cache aside then spares the engine its own death and restart. A second engine never
served a client: its output is vLLM's and ours only.
"""

from __future__ import annotations

from dataclasses import dataclass

# A rung's second engines whose port was taken, before the rung counts as failed: a port taken
# every time is one fixed for all of them (a port in [engine.args], vLLM's VLLM_PORT), not chance.
PORT_TAKEN_TRIES = 3


@dataclass(frozen=True)
class SpoiledBuild:
    set_aside: bool  # move vLLM's compile cache aside now
    held_against_rung: bool  # the rung counts as failed for this run (FailedRungs)
    why: str
    again: bool = False  # start it again now, on another port


def after_a_second_engines_death(spoiled: bool, launched_at: float, aside_at: float | None,
                                 ready_at: float | None, port_taken: bool = False,
                                 ports_taken_before: int = 0) -> SpoiledBuild:
    """``spoiled``: it printed vLLM's spoiled-cache error. Times on one monotonic clock:
    ``launched_at`` its launch, ``aside_at`` the cache's last set-aside (by anyone), ``ready_at``
    the engine's last READY; None where there was none in this run. ``port_taken``: it said a port
    it was to bind was in use; ``ports_taken_before``: how many of its rung's did so before it in
    this run."""
    if port_taken and not spoiled:
        if ports_taken_before + 1 < PORT_TAKEN_TRIES:
            return SpoiledBuild(False, False, "a port it was given was taken before it bound it: "
                                "started again on another", again=True)
        return SpoiledBuild(False, True, f"a port was taken {PORT_TAKEN_TRIES} times: one fixed "
                            "for every engine ([engine.args], VLLM_PORT in [engine.env])?")
    if not spoiled:
        return SpoiledBuild(False, True, "not the cache's: its own failure")
    if aside_at is not None and aside_at >= launched_at:
        return SpoiledBuild(False, False, "died on the cache moved aside since it was launched")
    if aside_at is not None and (ready_at is None or ready_at < aside_at):
        # on the cache made anew, with no READY since: not the cache (and no loop of set-asides)
        return SpoiledBuild(False, True, "the cache was moved aside already, with no READY since")
    return SpoiledBuild(True, False, "spoiled: moved aside before the engine dies of it")
