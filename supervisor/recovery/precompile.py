"""``[recovery] precompile``: the compiled graphs of the rungs a restart or a climb would pick, made while
the engine serves.

vLLM keys its torch.compile cache on a hash that includes ``max_num_batched_tokens`` and
``max_num_seqs`` (the compile ranges end at the batch token budget), so the first start at a new
rung compiles from scratch: on 2 CPU cores that is ~13 s more than a start from the cache. A
precompile is a throwaway engine at the rung with dummy weights (the load format is not part of
the hash), stopped as soon as it answers /health: its artifacts land in the same cache. It runs
niced, once the engine is idle, and is killed the moment the engine needs the host back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import structlog

from supervisor.bounds import GIB, THROWAWAY_STOP_S
from supervisor.config import Config
from supervisor.engine import ipc, launch
from supervisor.engine.logtail import LogTail
from supervisor.event_stream import Event, PrecompileCrashed, PrecompileStarted, RungPrecompiled
from supervisor.host import Host, files, leftovers
from supervisor.host.gpu import DeviceSnapshot, GpuLost, free_fraction
from supervisor.host.proctree import Child
from supervisor.host.vllm_http import EngineClient
from supervisor.profile import Profile
from supervisor.recovery.sizing import SECOND_ENGINE_RESERVE, activation_of
from supervisor.recovery.spare import SPARE_ENV, Spare, SpareKeeper
from supervisor.recovery.standby import fingerprint

log = structlog.get_logger("supervisor.recovery.precompile")
RECORD = "compiled.json"
# Not part of vLLM's compile hash: what lets a precompile be cheap (dummy weights) and fit beside the engine.
PRECOMPILE_ARGS = {"load_format": "dummy"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Precompiler:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 targets: Callable[[Profile], list[Profile]], keeper: SpareKeeper) -> None:
        self.cfg, self.host, self.publish, self.targets, self.keeper = cfg, host, publish, targets, keeper
        self.dir = Path()
        self._precompile: asyncio.Task[None] | None = None
        self._precompile_child: Child | None = None
        self._failed: set[str] = set()  # rungs whose precompile failed: not tried again in this run
        self.record = Path(cfg.state.dir) / RECORD
        self.compiled: dict[str, list[str]] = self._load()
        self.why = "not asked yet: the engine has not been idle long enough"
        self.gpu_host: bool | None = None  # NVML sees a device (asked once)

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    # ---- the compile record ------------------------------------------------------------------------
    def _load(self) -> dict[str, list[str]]:
        try:
            doc = files.read_json(self.record)
        except (OSError, ValueError):
            return {}
        return {str(k): [str(x) for x in v] for k, v in doc.items() if isinstance(v, list)} \
            if isinstance(doc, dict) else {}

    def _engine_id(self, version: str | None) -> str:
        return f"{version or '?'}:{fingerprint(self.cfg.engine)}:{json.dumps(self.cfg.engine.args, sort_keys=True)}"

    def is_compiled(self, profile: Profile, version: str | None) -> bool:
        return profile.compile_key() in self.compiled.get(self._engine_id(version), [])

    def note_compiled(self, profile: Profile, version: str | None) -> None:
        """A start reached READY at ``profile`` (or a precompile did): its graphs are in vLLM's cache now."""
        keys = self.compiled.setdefault(self._engine_id(version), [])
        if profile.compile_key() not in keys:
            keys.append(profile.compile_key())
            try:
                files.write_private(self.record, json.dumps(self.compiled, indent=1))
            except OSError as exc:
                log.warning("state.compiled_record_failed", error=str(exc))

    # ---- precompiling ----------------------------------------------------------------------------------
    async def allowed(self, rung: Profile) -> bool:
        """Whether a throwaway may compile ``rung`` now; ``self.why`` says why (or why not), for /status."""
        mode = self.cfg.recovery.precompile
        if mode != "auto":
            self.why = f'[recovery] precompile = "{mode}"'
            return mode == "on"
        try:
            snaps = await self.host.gpu_snapshot(self.cfg.engine.devices())
        except GpuLost:
            self.why = "the GPU is lost"
            return False
        if not snaps:
            self.why = "auto: no GPU, so a throwaway competes only for CPU, niced and while the engine is idle"
            return True
        ok, self.why = room_for_throwaway(snaps, self.cfg.engine.model, rung, self.cfg.engine.ranks())
        return ok

    async def maybe_precompile(self, profile: Profile, version: str | None, idle_for_s: float,
                               ready_for_s: float) -> None:
        """Once the engine was idle long enough (on a GPU host: READY long enough), compile the next rung the
        policy would pick, one at a time. On a GPU host the throwaway's compile is CPU work on many cores, niced,
        and its GPU memory is bounded to half of what is free, so it does not wait for a lull that busy
        servers never have: the seed's crash came under steady traffic. A spare whose rung is no longer the first
        of these (or that died asleep) is dropped first."""
        targets = [p for p in self.targets(profile) if p.compile_key() != profile.compile_key()]
        await self.keeper.check(targets[0] if targets else None)
        if self._precompile is not None and not self._precompile.done():
            return
        if self.gpu_host is None:
            try:
                self.gpu_host = bool(await self.host.gpu_snapshot(self.cfg.engine.devices()))
            except GpuLost:
                self.gpu_host = True
        if (ready_for_s if self.gpu_host else idle_for_s) < self.cfg.recovery.precompile_idle_s:
            return
        spare = await self._spare_for(targets[0]) if targets else None
        if spare is not None:  # a spare compiles its rung too, compiled already or not
            self._precompile = asyncio.create_task(self._guarded(spare, version, True), name="recovery:spare")
            return
        todo = [p for p in targets if not self.is_compiled(p, version) and p.compile_key() not in self._failed]
        if todo and await self.allowed(todo[0]):
            self._precompile = asyncio.create_task(self._guarded(todo[0], version), name="recovery:precompile")

    async def _spare_for(self, first: Profile) -> Profile | None:
        """The first target (the rung a runtime OOM would pick) at the utilization its spare starts at, when a
        spare is wanted and none is kept yet."""
        if self.keeper.spare is not None or first.compile_key() in self._failed:
            return None
        util = await self.keeper.wanted(first)
        return None if util is None else first.with_(gpu_memory_utilization=util)

    async def _guarded(self, rung: Profile, version: str | None, spare: bool = False) -> None:
        try:
            await self._compile(rung, version, spare)
        except Exception as exc:  # noqa: BLE001 - a precompile's own fault never stops the supervision
            self._failed.add(rung.compile_key())
            self.publish(PrecompileCrashed(at=self.host.wall(), profile=rung, error=repr(exc)))

    async def _compile(self, rung: Profile, version: str | None, spare: bool) -> None:
        """A throwaway engine at ``rung`` until it answers /health; a spare (``spare``: the real weights, sleep
        mode, the utilization it was given) is then kept asleep instead of stopped."""
        e = self.cfg.engine
        key = rung.compile_key()
        if spare:
            engine = replace(e, port=free_port(), args={**e.args, "enable_sleep_mode": True})
        else:
            rung = self._beside_the_engine(await self._snapshot(), rung)
            engine = replace(e, port=free_port(), args={**e.args, **PRECOMPILE_ARGS})
        work = self.dir / f"{'spare' if spare else 'precompile'}-{key.replace(' ', '').replace('-', '')[:40]}"
        argv = launch.build_argv(engine, rung, self.cfg.health.hang_timeout_s)
        if shutil.which("nice") and not spare:
            argv = ["nice", "-n", "10", *argv]  # never the engine (nor a spare, which becomes one): niced for good
        ipc_env = ipc.prepare_child_env(work, str(work / ipc.SOCKET_NAME), "INFO",
                                        dev_mode=spare or ipc.dev_mode(e.env))
        env = launch.build_env(e, ipc_env, str(work), withheld=self.cfg.withheld_env())
        if spare:
            env.update(SPARE_ENV)
        secrets = e.secrets()  # vLLM prints its args, --api-key included: the error quotes its last lines
        tail = LogTail(40, redact=lambda line: launch.redact(line, secrets))
        t0 = self.host.monotonic()
        self.publish(PrecompileStarted(at=self.host.wall(), profile=rung, port=engine.port))
        try:
            child = self._precompile_child = await self._spawn(argv, env)
        except OSError as exc:
            self._failed.add(key)
            self.publish(RungPrecompiled(at=self.host.wall(), profile=rung, ok=False, took_s=0.0,
                                         error=f"could not start {argv[0]!r}: {exc}"))
            return
        self._record(child)
        drains = [asyncio.create_task(tail.drain(s)) for s in (child.proc.stdout, child.proc.stderr) if s]
        client = EngineClient(engine.base_url, e.api_key(), ipc.control_token(env))
        ok, why, lines, kept = False, "", [], False
        try:
            ok, why = await self._until_healthy(child, client)
            lines = tail.snapshot()[-5:]  # what it printed while failing, not its shutdown
            if ok:
                self.note_compiled(rung, version)  # its graphs are in the cache, whatever becomes of it now
            if ok and spare:
                kept = await self.keeper.keep(Spare(child, rung, engine.base_url, work, tail, drains, client,
                                                    tuple(launch.masked(argv, secrets)), version), t0)
        finally:
            if not kept:
                await client.close()
                await self.host.terminate_tree(child, THROWAWAY_STOP_S, THROWAWAY_STOP_S)
                for d in drains:
                    d.cancel()
                shutil.rmtree(work, ignore_errors=True)
            leftovers.clear(self.cfg.state.dir, leftovers.PRECOMPILE)  # a kept spare has a record of its own
            self._precompile_child = None
        took = round(self.host.monotonic() - t0, 3)
        if not ok and spare:
            self.keeper.refused.add(key)  # the rung is precompiled plainly next time, not given up
        elif not ok:
            self._failed.add(key)
        self.publish(RungPrecompiled(at=self.host.wall(), profile=rung, ok=ok, took_s=took,
                                     error=None if ok else f"{why}; last lines: {' | '.join(lines)}"))

    async def _snapshot(self) -> list[DeviceSnapshot]:
        try:
            return await self.host.gpu_snapshot(self.cfg.engine.devices())
        except GpuLost:
            return []

    async def _spawn(self, argv: list[str], env: dict[str, str]) -> Child:
        """Spawn the throwaway; cancelled meanwhile (the engine died), the process that did start is stopped
        before the cancellation goes on: a throwaway nobody holds would keep its share of the GPU."""
        spawning = asyncio.ensure_future(self.host.spawn(argv, env))
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.host.terminate_tree(await spawning, THROWAWAY_STOP_S, THROWAWAY_STOP_S)
            raise

    def _record(self, child: Child) -> None:
        """Like the engine's: a supervisor SIGKILLed while this runs is followed by one that stops it."""
        try:
            leftovers.write(self.cfg.state.dir, leftovers.EngineRecord(
                child.sid, self.host.birth(child.pid), os.getpid()), leftovers.PRECOMPILE)
        except (OSError, psutil.Error) as exc:
            log.warning("state.precompile_record_failed", error=str(exc))

    @staticmethod
    def _beside_the_engine(snaps: list[DeviceSnapshot], rung: Profile) -> Profile:
        """On a GPU the throwaway must fit in what the serving engine left: half of it (vLLM's start check wants
        utilization x total free). The utilization is not part of the compile hash."""
        free = free_fraction(snaps)
        if free is None:
            return rung
        return rung.with_(gpu_memory_utilization=round(max(0.01, free / 2), 3))

    async def _until_healthy(self, child: Child, client: EngineClient) -> tuple[bool, str]:
        deadline = self.host.monotonic() + self.cfg.recovery.precompile_timeout_s
        while self.host.monotonic() < deadline:
            self.host.tree_pids(child)  # its EngineCore holds GPU memory: ours, not a foreign process's
            if child.proc.returncode is not None:
                return False, f"exited with status {child.proc.returncode}"
            if await client.health(timeout=2.0) == 200:
                return True, ""
            await self.host.sleep(0.5)
        return False, f"no /health 200 within {self.cfg.recovery.precompile_timeout_s:g}s"

    def stop(self) -> None:
        """The engine ended (it failed or stops): a precompile under way is killed, not waited for. The kill runs
        beside the engine's own stop; ``settled`` waits for it before the next start."""
        if self._precompile is not None:
            _cancel_once(self._precompile)

    async def settled(self) -> None:
        """No precompile left running (its processes may hold memory the next start needs)."""
        task, self._precompile = self._precompile, None
        if task is not None:
            _cancel_once(task)
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def pids(self) -> set[int]:
        """Processes of ours besides the engine (a precompile may hold GPU memory)."""
        child = self._precompile_child
        return set(child.known_pids) if child is not None else set()

    def status(self) -> dict[str, Any]:
        return {"running": self.running(), "why": self.why}

    def running(self) -> bool:
        return bool(self._precompile is not None and not self._precompile.done())

    async def close(self) -> None:
        await self.settled()


def _cancel_once(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` unless it is done or already being cancelled: a second cancel would land in its cleanup
    (stopping the throwaway's processes) and leave a throwaway slow to stop running into the next start."""
    if not task.done() and not task.cancelling():
        task.cancel()


def room_for_throwaway(snaps: Sequence[DeviceSnapshot], model: str, rung: Profile,
                       ranks: int = 1) -> tuple[bool, str]:
    """On a GPU, "auto" compiles ahead only when half of what the serving engine left free holds a second copy
    of the weights, the rung's prefill peak and a little KV cache (the throwaway takes half: vLLM's start
    check wants utilization x total free). A tensor-parallel engine's throwaway has as many ranks, each with
    1/N of the weights and of the prefill: that must fit on every device (the smallest free one decides)."""
    weights = files.weights_on_disk(model)
    if weights is None:
        return False, "auto: the model is not a local directory with weights, so their size is unknown"
    weights //= max(1, ranks)
    need = weights + activation_of(model, rung) // max(1, ranks) + SECOND_ENGINE_RESERVE
    half = min(s.free for s in snaps) // 2
    if half < need:
        return False, (f"auto: the card has {2 * half / GIB:.1f} GiB free beside the engine; a throwaway needs "
                       f"about {need / GIB:.1f} GiB in half of it (weights {weights / GIB:.1f} GiB, the rung's "
                       f"prefill, context and a minimal KV cache)")
    return True, (f"auto: half of the {2 * half / GIB:.1f} GiB free beside the engine holds a throwaway "
                  f"(about {need / GIB:.1f} GiB)")
