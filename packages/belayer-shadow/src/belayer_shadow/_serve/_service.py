"""`RolloutService`: the router (in this process) and N slots behind it, from one model folder.

    async with RolloutService.start(ServeConfig(model_dir, num_slots=2)) as service:
        service.url  # OpenAI routes under service.url + "/v1"

The router's control plane (``/pause``, ``/resume``, ``/update_weights {"weight_dir"}``,
``/update_weights_from_disk {"model_path"}``, ...) loads new weights into every slot's weight
server through `SlotWeights`.

Start order: check the folder (nothing starts for a bad one), the guardian, the router, then every
slot at once (memory servers filled from the folder's safetensors, main worker, shadow standing
by). Stop order is the reverse and runs shielded from cancellation, so Ctrl-C still stops every
slot. A SIGKILL of the process leaves nothing either: each slot's guardian and the service's own
(`_guardian.py`) reap the children and remove a temporary run folder.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import attrs

from belayer_gpumem import BelayerGpumemError
from belayer_router import RouterApp, running_router
from belayer_shadow._errors import BelayerShadowError, ModelConfigError, SupervisorError, WeightsError
from belayer_shadow._serve._config import ServeConfig
from belayer_shadow._serve._guardian import ServeGuardian
from belayer_shadow._serve._model_folder import ModelFolder
from belayer_shadow._serve._weights import SlotWeights
from belayer_shadow._workers._slot import SlotSupervisor
from belayer_shadow._workers._slot_config import SlotConfig

__all__ = ["RolloutService"]

_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


@attrs.define(eq=False)
class RolloutService:
    """A running service: its base URL, its router app and its slot supervisors."""

    config: ServeConfig
    model: ModelFolder
    url: str
    run_dir: Path
    app: RouterApp
    weights: SlotWeights
    slots: list[SlotSupervisor] = attrs.field(factory=list)

    @property
    def openai_base_url(self) -> str:
        """The base URL an OpenAI client takes (`.../v1`)."""
        return self.url + "/v1"

    @classmethod
    @asynccontextmanager
    async def start(
        cls, config: ServeConfig, sock: socket.socket | None = None
    ) -> AsyncIterator[RolloutService]:
        """Start everything; yield once every slot serves (and its shadow stands by); stop at exit.
        `sock`: the router's listening socket, bound already (by `serve --keep-running`'s keeper,
        which keeps it across restarts), instead of `config.host:config.port`."""
        model = ModelFolder.inspect(config.model_dir)
        admin_token = secrets.token_hex(16)
        router_config = config.router_config(model, admin_token)
        temporary = config.run_dir is None
        run_dir = Path(tempfile.mkdtemp(prefix="belayer-serve-")) if temporary else config.run_dir
        assert run_dir is not None
        run_dir.mkdir(parents=True, exist_ok=True)
        guardian = ServeGuardian.start(run_dir, remove=temporary)
        weights = SlotWeights([], scratch_dir=run_dir / "weight-transfer")
        try:
            async with AsyncExitStack() as stack:
                url, app = await stack.enter_async_context(
                    running_router(
                        router_config,
                        config.host,
                        config.port,
                        server=config.router_server,
                        weight_loader=weights,
                        sock=sock,
                    )
                )
                service = cls(config=config, model=model, url=url, run_dir=run_dir, app=app, weights=weights)
                service.slots = [
                    SlotSupervisor(
                        _slot_config(config, index, _reachable(url, config.host), admin_token, run_dir)
                    )
                    for index in range(config.num_slots)
                ]
                if config.adopt_kept_weights:
                    for supervisor in service.slots:
                        supervisor.adopt_kept_weights()
                wired = SlotWeights.for_slots(service.slots)  # the router holds `weights` already
                weights.sockets, weights.keepers, weights.names = wired.sockets, wired.keepers, wired.names
                weights.accepts, weights.keep_if_out = wired.accepts, wired.keep_if_out
                stack.push_async_callback(service._stop_slots)
                try:
                    async with anyio.create_task_group() as group:
                        for supervisor in service.slots:
                            group.start_soon(_start_slot, supervisor, config.start_timeout_s)
                except* (BelayerShadowError, BelayerGpumemError, OSError, TimeoutError) as errors:
                    first = errors.exceptions[0]
                    if isinstance(first, ModelConfigError | WeightsError):
                        raise first from None  # bad input (weights that do not fit): keep its type
                    raise SupervisorError(
                        f"a slot did not start: {first}; see the logs under {run_dir / 'slots'}"
                    ) from first
                yield service
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(guardian.close)

    async def _stop_slots(self) -> None:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for supervisor in self.slots:
                    group.start_soon(anyio.to_thread.run_sync, supervisor.stop)


def _reachable(url: str, host: str) -> str:
    """The router's URL as the slots on this machine reach it (not a wildcard address)."""
    if host not in _WILDCARD_HOSTS:
        return url
    port = url.rsplit(":", 1)[1]
    return f"http://127.0.0.1:{port}"


def _slot_config(
    config: ServeConfig, index: int, router_url: str, admin_token: str, run_dir: Path
) -> SlotConfig:
    return SlotConfig(
        slot=f"slot{index}",
        router_url=router_url,
        run_dir=run_dir / "slots" / f"slot{index}",
        admin_token=admin_token,
        device=index if config.backend == "cuda" else 0,
        **config.slot_options(),
    )


async def _start_slot(supervisor: SlotSupervisor, timeout_s: float) -> None:
    try:
        await anyio.to_thread.run_sync(supervisor.start)
        await anyio.to_thread.run_sync(supervisor.wait_protected, timeout_s)
    except BaseException:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await anyio.to_thread.run_sync(supervisor.stop)
        raise
