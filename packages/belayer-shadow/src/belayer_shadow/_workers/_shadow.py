"""The shadow worker: stand by beside the main worker, then take its slot over in well under a second.

Standby: the engine is built on the same memory regions and warmed up, the private scratch
buffer is released (gpumem's `IdleBuffer`), and the process only polls the heartbeat's mtime and
the handover flag, sleeping in between (no CPU to speak of). Handover, each step timed and logged:
detect -> fence (SIGKILL a hung main, so it cannot write the shared KV arena again) -> health check
(device, memory servers alive) -> flush the KV pool -> remap the scratch buffer -> warm up ->
register at epoch + 1 (the router retires the failed worker and resumes its requests here) -> serve.
If the device check fails, the shadow does not serve from that memory: it marks the slot unhealthy
at the router and exits with `EXIT_UNHEALTHY`. If a memory server is gone (or does not answer), it
does not serve either, but the GPU is not to blame: it leaves the slot healthy, writes the state
`memory_lost` and exits with `EXIT_MEMORY_LOST`; the supervisor restarts the slot from scratch.
"""

from __future__ import annotations

import os
import select
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch

from belayer_gpumem import BelayerGpumemError, IdleBuffer, check_gpu_health, ping
from belayer_router import RouterClient, RouterClientError
from belayer_shadow._errors import HandoverError, MemoryServerLostError
from belayer_shadow._workers._events import EventLog, write_state
from belayer_shadow._workers._heartbeat import HandoverFlag, HangDetector, Heartbeat
from belayer_shadow._workers._service import Engine, EngineService
from belayer_shadow._workers._worker import (
    NUM_WARMUPS,
    WorkerConfig,
    build_engine,
    check_weights_shared,
    serve_service,
    trim_heap,
)

__all__ = ["EXIT_MEMORY_LOST", "EXIT_UNHEALTHY", "ShadowConfig", "check_device_health", "run_shadow"]

EXIT_UNHEALTHY = 3
EXIT_MEMORY_LOST = 1  # ExitCode.FAILED; the supervisor tells it by the state `memory_lost`


@attrs.frozen
class ShadowConfig:
    """A shadow worker: the worker configuration plus how it watches the main and what it holds idle."""

    worker: WorkerConfig
    handover_flag: Path = attrs.field(converter=Path)
    poll_s: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))
    stale_s: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    scratch_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=attrs.validators.ge(0))
    # Touched at every standby poll: the supervisor takes a shadow whose file goes stale for hung
    # and replaces it before the main fails (None: no such file).
    alive_file: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))


def check_device_health(device: torch.device) -> str:
    """The device check of a handover: gpumem's kernel check on cuda, an exact tensor op on the host."""
    if device.type == "cuda":
        return check_gpu_health(device.index or 0, timeout_s=2.0).detail
    n = 4096
    total = (torch.arange(n, dtype=torch.float32) * 2 + 1).sum().item()  # = n**2, exact in float32
    eye = torch.eye(64) @ torch.full((64, 64), 3.0)
    if total != float(n * n) or not bool((eye == 3.0).all()):
        raise HandoverError(f"host tensor check gave wrong results (sum {total}, expected {n * n})")
    return "host tensor ops correct"


def _fence(pid: int | None) -> str:
    """SIGKILL the process that wrote the heartbeat (a hung main) and wait until it is gone."""
    if pid is None or pid == os.getpid():
        return "no main to fence"
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return f"main {pid} already gone"
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], 5.0)  # a pidfd turns readable when the process exits
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
    return f"killed main {pid}"


async def _stand_by(
    config: ShadowConfig, engine: Engine, heartbeat: Heartbeat, flag: HandoverFlag, log: EventLog
) -> dict[str, Any]:
    """Sleep-poll until the flag is raised or the heartbeat goes stale; returns what triggered it.

    The engine holds no weight pin meanwhile (the trainer's updates never wait for a standby
    shadow); the handover's flush step moves it to the latest version.
    """
    alive = None if config.alive_file is None else Heartbeat(config.alive_file)
    if alive is not None:
        alive.touch()
    engine.release_weights()
    trim_heap()  # what standing by released goes back to the system
    check_weights_shared(engine, log)
    hangs = HangDetector(config.stale_s, config.poll_s)
    while True:
        if alive is not None:
            alive.touch()
        if flag.is_raised():
            return {"trigger": "flag", **(flag.read() or {})}
        age = heartbeat.age_s()
        if hangs.is_hung(age, time.monotonic()):
            return {"trigger": "stale_heartbeat", "age_s": age}
        await anyio.sleep(config.poll_s)


def _take_over(
    config: ShadowConfig, engine: Engine, scratch: IdleBuffer, log: EventLog, pid: int | None
) -> None:
    with log.step("handover.fence"):
        log.emit("handover.fenced", detail=_fence(pid))
    with log.step("handover.health_check"):
        detail = check_device_health(engine.device)
        for socket_path in (config.worker.weights_socket, config.worker.kv_socket):
            try:
                ping(socket_path, timeout_s=1.0)
            except (BelayerGpumemError, OSError) as exc:
                raise MemoryServerLostError(f"memory server at {socket_path} is gone: {exc}") from exc
        log.emit("handover.healthy", detail=detail)
    with log.step("handover.flush"):
        engine.flush_kv()
        engine.refresh_weights()
    with log.step("handover.remap", nbytes=scratch.nbytes):
        scratch.restore()
    with log.step("handover.warmup"):
        engine.warmup()


def run_shadow(config: ShadowConfig) -> int:
    """Stand by, take over, serve until SIGTERM/SIGINT; returns the process exit code."""
    worker = config.worker
    log = EventLog(worker.event_log, f"shadow:{os.getpid()}")
    with log.step("shadow.attach"):
        engine = build_engine(worker)
    service: EngineService | None = None
    try:
        with log.step("shadow.warmup"):
            for _ in range(NUM_WARMUPS):  # the first runs of each shape are slow; pay for them now
                engine.warmup()
        backend = "cuda" if engine.device.type == "cuda" else "host"
        scratch = IdleBuffer.allocate(config.scratch_bytes, backend=backend, device=engine.device.index or 0)
        scratch.release()
        heartbeat, flag = Heartbeat(worker.heartbeat), HandoverFlag(config.handover_flag)
        # Epoch 0 until the handover: the router never sends it requests of that epoch.
        service = EngineService(engine, heartbeat, log, idle_tick_s=worker.idle_tick_s)
        failed = False
        memory_lost = False

        async def prepare(router: RouterClient, url: str) -> bool:
            nonlocal failed, memory_lost
            write_state(worker.state_file, "standby", url=url)
            log.emit("standby", url=url, scratch_bytes=scratch.nbytes)
            trigger = await _stand_by(config, engine, heartbeat, flag, log)
            main_pid = heartbeat.writer_pid()
            write_state(worker.state_file, "handover", **trigger)
            log.emit("handover.detect", **trigger)
            try:
                _take_over(config, engine, scratch, log, main_pid)
            except MemoryServerLostError as exc:
                memory_lost = True
                log.emit("handover.failed", error=str(exc))
                write_state(worker.state_file, "memory_lost", error=str(exc))
                return False
            except (HandoverError, BelayerGpumemError) as exc:
                failed = True
                log.emit("handover.failed", error=str(exc))
                write_state(worker.state_file, "failed", error=str(exc))
                try:
                    await router.mark_unhealthy(worker.slot)
                    log.emit("slot.unhealthy", slot=worker.slot, reason=str(exc))
                except (RouterClientError, OSError) as router_exc:
                    log.emit("slot.unhealthy_failed", error=str(router_exc))
                return False
            return True

        anyio.run(lambda: serve_service(service, worker, prepare=prepare))
        return EXIT_UNHEALTHY if failed else EXIT_MEMORY_LOST if memory_lost else 0
    finally:
        if service is not None and service.step_in_progress:  # as in `run_worker`
            log.emit("worker.close_skipped", reason="engine.step() still running after the stop")
        else:
            engine.close()
