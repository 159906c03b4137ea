"""System assembly: the router (in this process) and the engine slots (memory servers, main worker
and shadow worker each), started in order and stopped in reverse, leaving nothing behind.

    async with RolloutSystem.start(config, run_dir, model_config, weights_file) as system:
        async with system.client() as router: ...

Stopping runs shielded from cancellation, so Ctrl-C (which cancels the training task) still stops
every slot: no process, socket or memory segment outlives the run.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from belayer_grpo._config import Config
from belayer_grpo._errors import SystemStartError
from belayer_router import RouterClient, RouterConfig, running_router

if TYPE_CHECKING:
    from belayer_shadow import ModelConfig, SlotSupervisor

__all__ = ["RolloutSystem"]


@attrs.define
class RolloutSystem:
    """The running router and slots of one training run."""

    router_url: str
    admin_token: str
    slots: list[SlotSupervisor]
    run_dir: Path

    @classmethod
    @asynccontextmanager
    async def start(
        cls, config: Config, run_dir: Path, model_config: ModelConfig, weights_file: Path
    ) -> AsyncIterator[RolloutSystem]:
        """Start the router and ``system.num_slots`` slots serving ``weights_file``; stop them at exit."""
        from belayer_shadow import BelayerShadowError, SlotConfig, SlotSupervisor

        admin_token = secrets.token_hex(16)
        model_file = run_dir / "model.json"
        model_file.write_text(json.dumps(model_config.to_dict(), indent=2))
        router_config = RouterConfig(admin_token=admin_token, resume_wait_s=30.0)
        async with AsyncExitStack() as stack:
            url, _app = await stack.enter_async_context(running_router(router_config))
            system = cls(router_url=url, admin_token=admin_token, slots=[], run_dir=run_dir)
            stack.push_async_callback(system._stop_slots)
            for index in range(config.system.num_slots):
                supervisor = SlotSupervisor(
                    SlotConfig(
                        slot=f"slot{index}",
                        router_url=url,
                        run_dir=run_dir / "slots" / f"slot{index}",
                        admin_token=admin_token,
                        model=model_file,
                        weights=weights_file,
                        seed=config.model.seed,
                        recovery=config.system.recovery,  # type: ignore[arg-type]
                        num_kv_blocks=config.system.kv_num_blocks,
                        block_size=config.system.kv_block_size,
                        max_num_seqs=min(config.rollout.concurrency, 256),
                        start_timeout_s=config.system.start_timeout_s,
                        stale_s=config.system.hang_threshold_s,
                        engine=config.system.engine,
                    )
                )
                system.slots.append(supervisor)
            try:
                async with anyio.create_task_group() as group:
                    for supervisor in system.slots:
                        group.start_soon(_start_slot, supervisor, config.system.start_timeout_s)
            except* (BelayerShadowError, OSError, TimeoutError) as errors:
                first = errors.exceptions[0]
                raise SystemStartError(
                    f"an engine slot did not start: {first}; see the logs under {run_dir / 'slots'}"
                ) from first
            yield system

    async def _stop_slots(self) -> None:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for supervisor in self.slots:
                    group.start_soon(anyio.to_thread.run_sync, supervisor.stop)

    @property
    def weight_sockets(self) -> list[Path]:
        """Every slot's weight server socket."""
        return [supervisor.weights_socket for supervisor in self.slots]

    def client(self, timeout_s: float = 600.0, multiplex: bool = True) -> RouterClient:
        """A router client for rollouts (use as ``async with``).  ``multiplex`` (default): every
        concurrent generation travels on one client link (belayer-router's ``POST /client-link``),
        so the router writes one frame per turn for all of them, not one write per token each."""
        return RouterClient(self.router_url, self.admin_token, timeout_s=timeout_s, multiplex=multiplex)

    def events(self) -> list[dict[str, Any]]:
        """Every slot's events, each tagged with its slot, in time order."""
        merged = []
        for supervisor in self.slots:
            for event in supervisor.events():
                merged.append({**event, "slot": supervisor.config.slot})
        return sorted(merged, key=lambda event: float(event.get("time", 0.0)))

    def num_handovers(self) -> int:
        """Completed handovers (or conventional restarts) over all slots."""
        return sum(supervisor.num_handovers for supervisor in self.slots)

    def healthy_slots(self) -> list[int]:
        """Indices of slots still in service."""
        return [index for index, supervisor in enumerate(self.slots) if supervisor.healthy]


async def _start_slot(supervisor: SlotSupervisor, timeout_s: float) -> None:
    # start() blocks until the main worker serves; wait_protected until the shadow stands by, so
    # that a failure injected from the first step on is recoverable.
    try:
        await anyio.to_thread.run_sync(supervisor.start)
        await anyio.to_thread.run_sync(supervisor.wait_protected, timeout_s)
    except BaseException:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await anyio.to_thread.run_sync(supervisor.stop)
        raise
