"""The main worker: attach to the memory servers, build and warm the engine, serve, register.

`serve_service` is shared with the shadow worker, which calls it once it has taken over.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch

from belayer_router import RouterClient, RouterClientError
from belayer_router.asgi import serving
from belayer_shadow._engine._config import ModelConfig
from belayer_shadow._engine._llm_engine import LLMEngine
from belayer_shadow._errors import WorkerError
from belayer_shadow._workers._events import EventLog, write_state
from belayer_shadow._workers._heartbeat import Heartbeat
from belayer_shadow._workers._service import Engine, EngineService, ResumeMode

__all__ = [
    "NUM_WARMUPS",
    "WorkerConfig",
    "build_engine",
    "check_weights_shared",
    "register_worker",
    "run_worker",
    "serve_service",
    "trim_heap",
]

NUM_WARMUPS = 3


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`): a process that
    freed much at start (vLLM's load, a standby shadow's dropped buffers) keeps them private
    otherwise. False where the C library has no `malloc_trim`."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def check_weights_shared(engine: Engine, log: EventLog) -> list[str]:
    """Log (`weights.private`) which weights the engine holds as private copies instead of views
    of the weight server (the design wants none) and how much the process holds; returns them."""
    private = engine.private_weights()
    log.emit("weights.private", names=private[:20], count=len(private), **_memory())
    return private


def _memory() -> dict[str, int]:
    """This process's PSS and private bytes (Linux smaps_rollup), {} elsewhere."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines()[1:] if ":" in line)
    kib = {key.strip(): int(value.split()[0]) for key, value in fields.items() if value.split()}
    return {
        "pss_bytes": kib.get("Pss", 0) * 1024,
        "private_bytes": (kib.get("Private_Clean", 0) + kib.get("Private_Dirty", 0)) * 1024,
    }


def _optional_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen
class WorkerConfig:
    """Everything a main or shadow worker is started with; the CLI flags map one to one.

    `epoch=None` registers at the slot's highest epoch + 1 (read from the router). `state_file`
    receives the worker's state (`standby`, `handover`, `serving`, `failed`) for a supervisor.
    """

    slot: str
    router_url: str
    weights_socket: Path = attrs.field(converter=Path)
    kv_socket: Path = attrs.field(converter=Path)
    heartbeat: Path = attrs.field(converter=Path)
    admin_token: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    model: Path | None = attrs.field(default=None, converter=_optional_path)
    epoch: int | None = None
    event_log: Path | None = attrs.field(default=None, converter=_optional_path)
    state_file: Path | None = attrs.field(default=None, converter=_optional_path)
    resume_mode: ResumeMode = attrs.field(
        default="continue", validator=attrs.validators.in_(("continue", "regenerate"))
    )
    max_num_seqs: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_num_batched_tokens: int = attrs.field(default=8192, validator=attrs.validators.ge(1))
    idle_tick_s: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))
    # One intra-op thread by default: on a shared, busy CPU a second thread that is not scheduled
    # stalls every parallel op at its barrier (warm-ups of 3 ms became 1 s under load).
    num_threads: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # `vllm`: a real vLLM engine in this process on the weight server (belayer-shadow[vllm]).
    engine: str = attrs.field(default="belayer", validator=attrs.validators.in_(("belayer", "vllm")))

    def model_config(self) -> ModelConfig:
        """The model configuration: `model` (a JSON file or HF folder) or the built-in default."""
        return ModelConfig.default() if self.model is None else ModelConfig.from_json_file(self.model)


def build_engine(config: WorkerConfig) -> Engine:
    """An engine attached to the slot's memory servers (zero copy), on `num_threads` CPU threads."""
    torch.set_num_threads(config.num_threads)
    if config.engine == "vllm":
        from belayer_shadow._vllm import VllmEngine

        return VllmEngine(
            config.model_config(),
            config.weights_socket,
            model=config.model,
            kv_socket=config.kv_socket,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_threads=config.num_threads,
        )
    return LLMEngine.attach(
        config.model_config(),
        config.weights_socket,
        config.kv_socket,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )


async def register_worker(
    router: RouterClient, slot: str, url: str, service: EngineService, epoch: int | None = None
) -> int:
    """Register `url` for `slot` at `epoch` (default: the slot's highest epoch + 1); returns the epoch.

    The service serves the epoch before the router learns of it, so the first request matches.
    Raises WorkerError when the slot is unhealthy or the router refuses.
    """
    for _ in range(20):
        if epoch is None:
            slots = {s["slot"]: s for s in await router.workers()}
            state: dict[str, Any] = slots.get(slot, {"max_epoch": 0, "healthy": True})
            if not state["healthy"]:
                raise WorkerError(f"slot {slot!r} is marked unhealthy at the router; use another slot")
            service.epoch = max(int(state["max_epoch"]), 0) + 1
        else:
            service.epoch = epoch
        try:
            await router.register(slot, url, service.epoch, link=True)
            return service.epoch
        except RouterClientError as exc:
            if exc.status != 409 or epoch is not None:
                raise WorkerError(f"the router refused to register {url} for slot {slot!r}: {exc}") from exc
    raise WorkerError(f"could not register for slot {slot!r}: other workers keep taking the next epoch")


async def _until_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


# Runs after the HTTP server is up and before the loop starts and the worker registers; False: do not serve.
Prepare = Callable[[RouterClient, str], Awaitable[bool]]


async def serve_service(
    service: EngineService, config: WorkerConfig, *, prepare: Prepare | None = None
) -> None:
    """Serve `service` over HTTP, run its loop, register with the router; until SIGTERM/SIGINT.

    The shadow worker passes `prepare` (stand by, then take over): its HTTP server is already up
    while it stands by, and registration becomes the timed handover step `handover.register`.
    """
    log = service.log
    async with (
        RouterClient(config.router_url, config.admin_token, timeout=30.0) as router,
        serving(service, config.host, config.port, log_level="warning") as url,
        anyio.create_task_group() as group,
    ):
        group.start_soon(_until_signal, group.cancel_scope)
        if prepare is not None and not await prepare(router, url):
            group.cancel_scope.cancel()
            return
        group.start_soon(service.run_loop)
        if prepare is not None:
            with log.step("handover.register", url=url):
                epoch = await register_worker(router, config.slot, url, service, config.epoch)
        else:
            epoch = await register_worker(router, config.slot, url, service, config.epoch)
        log.emit("registered", slot=config.slot, url=url, epoch=epoch)
        write_state(config.state_file, "serving", url=url, epoch=epoch)
        try:
            await anyio.sleep_forever()
        finally:
            # A newer epoch may own the slot, or the router may be gone: nothing to undo then.
            with anyio.move_on_after(2, shield=True), contextlib.suppress(RouterClientError, OSError):
                await router.unregister(config.slot, epoch)
            log.emit("stopped")


def run_worker(config: WorkerConfig) -> None:
    """The main worker: attach, warm up, serve and register; blocks until SIGTERM/SIGINT."""
    log = EventLog(config.event_log, f"worker:{os.getpid()}")
    with log.step("worker.attach"):
        engine = build_engine(config)
    service: EngineService | None = None
    try:
        with log.step("worker.warmup"):
            for _ in range(NUM_WARMUPS):  # the first runs of each shape are slow; pay for them now
                engine.warmup()
            engine.bind_kv()  # vLLM: onto the arena now, its own warm-up buffer freed
            trim_heap()
        check_weights_shared(engine, log)
        service = EngineService(
            engine,
            Heartbeat(config.heartbeat),
            log,
            resume_mode=config.resume_mode,
            idle_tick_s=config.idle_tick_s,
        )
        anyio.run(serve_service, service, config)
    finally:
        if service is not None and service.step_in_progress:
            # A hung engine.step() outlived the stop's bound: closing the engine under it could hang
            # or crash; the process exits now and the daemon stepping thread ends with it.
            log.emit("worker.close_skipped", reason="engine.step() still running after the stop")
        else:
            engine.close()
