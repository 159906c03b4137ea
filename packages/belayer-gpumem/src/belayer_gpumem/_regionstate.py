"""What a server does with its region for each op: the request handlers, free of socket I/O."""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import attrs

from belayer_gpumem._backends import ServerRegion, create_region
from belayer_gpumem._config import ServerConfig
from belayer_gpumem._double_buffer import DoubleBufferConflictError, WeightDoubleBuffer
from belayer_gpumem._errors import BelayerGpumemError, LayoutError, RemoteError, UpdateBusyError
from belayer_gpumem._layout import KVLayout, WeightLayout
from belayer_gpumem._safetensors_io import read_safetensors

__all__ = ["RegionState"]

Reply = dict[str, Any]
_DEFAULT_UPDATE_WAIT_S = 30.0
_MAX_UPDATE_WAIT_S = 600.0


def _load_weights(config: ServerConfig) -> tuple[WeightLayout, ServerRegion, int]:
    if config.safetensors is not None:
        source = read_safetensors(config.safetensors)
        region = create_region(config.backend, source.layout.region_bytes, device=config.device)
        source.copy_into(region.write)  # into slot 0, the live slot of version 1
        region.synchronize()  # the copies must have landed before any client is told "ready"
        return source.layout, region, 1
    assert config.layout_file is not None
    try:
        text = config.layout_file.read_text()
    except OSError as exc:
        raise LayoutError(f"cannot read layout file {config.layout_file}: {exc}") from exc
    import json

    try:
        layout = WeightLayout.from_json(json.loads(text))
    except json.JSONDecodeError as exc:
        raise LayoutError(f"layout file {config.layout_file} is not JSON: {exc}") from exc
    region = create_region(config.backend, layout.region_bytes, device=config.device)
    return layout, region, config.start_version


@attrs.define
class RegionState:
    """One server's region, its layout and its counters; one method per protocol op."""

    config: ServerConfig
    region: ServerRegion
    weights: WeightLayout | None = None
    kv: KVLayout | None = None
    buffer: WeightDoubleBuffer = attrs.field(factory=WeightDoubleBuffer)
    generation: int = 0
    started_at: float = attrs.field(factory=time.monotonic)
    _changed: anyio.Event = attrs.field(factory=anyio.Event)

    @classmethod
    def allocate(cls, config: ServerConfig) -> RegionState:
        """Allocate the region (and load the weights, if a file was given). Blocking."""
        if config.kind == "weights":
            layout, region, version = _load_weights(config)
            return cls(
                config=config, region=region, weights=layout, buffer=WeightDoubleBuffer(version=version)
            )
        assert config.kv_layout is not None
        region = create_region(config.backend, config.kv_layout.region_bytes, device=config.device)
        return cls(config=config, region=region, kv=config.kv_layout)

    def close(self) -> None:
        """Release the server's hold on the region."""
        self.region.close()

    def disconnect(self, conn: int) -> None:
        """A connection went away: drop its pin and abort its update."""
        self.buffer.disconnect(conn)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _need(self, kind: str, op: str) -> None:
        if self.config.kind != kind:
            raise RemoteError(
                "wrong_kind", f"op {op!r} is for a {kind} server; this is a {self.config.kind} server"
            )

    async def handle(self, conn: int, op: str, request: dict[str, Any]) -> Reply:
        """Run one validated request; raises RemoteError for refusals."""
        handler = getattr(self, f"_op_{op}")
        try:
            reply: Reply = await handler(conn, request)
        except DoubleBufferConflictError as exc:
            raise RemoteError("conflict", str(exc)) from exc
        return {"ok": True, **reply}

    async def _op_ping(self, conn: int, request: dict[str, Any]) -> Reply:
        return {"kind": self.config.kind, "pid": os.getpid(), "uptime_s": time.monotonic() - self.started_at}

    async def _op_describe(self, conn: int, request: dict[str, Any]) -> Reply:
        reply: Reply = {
            "kind": self.config.kind,
            "backend": self.config.backend,
            "device": self.config.device,
            "region_bytes": self.region.nbytes,
            "pid": os.getpid(),
        }
        if self.weights is not None:
            reply |= {"version": self.buffer.version, "active_slot": self.buffer.active_slot}
            reply["layout"] = self.weights.to_json()
        if self.kv is not None:
            reply |= {"generation": self.generation, "layout": self.kv.to_json()}
        return reply

    async def _op_open(self, conn: int, request: dict[str, Any]) -> Reply:
        # The connection layer attaches the region fd to this reply.
        return {
            "region_bytes": self.region.nbytes,
            "backend": self.config.backend,
            "device": self.config.device,
        }

    async def _op_health(self, conn: int, request: dict[str, Any]) -> Reply:
        if self.config.backend == "cuda":
            from belayer_gpumem._health import check_gpu_health

            try:
                report = await anyio.to_thread.run_sync(check_gpu_health, self.config.device)
            except BelayerGpumemError as exc:
                raise RemoteError("unhealthy", str(exc)) from exc
            return {"healthy": True, "detail": report.detail}
        self.region.read(0, 1)  # the mapping is still there
        return {"healthy": True, "detail": "host region mapped"}

    async def _op_flush(self, conn: int, request: dict[str, Any]) -> Reply:
        self._need("kv", "flush")
        await anyio.to_thread.run_sync(self.region.zero, 0, self.region.nbytes)
        self.generation += 1
        return {"generation": self.generation}

    async def _op_acquire(self, conn: int, request: dict[str, Any]) -> Reply:
        self._need("weights", "acquire")
        assert self.weights is not None
        slot, version = self.buffer.pin(conn)
        self._notify()
        return {"slot": slot, "version": version, "slot_offset": slot * self.weights.slot_bytes}

    async def _op_release(self, conn: int, request: dict[str, Any]) -> Reply:
        self._need("weights", "release")
        self.buffer.unpin(conn)
        self._notify()
        return {}

    async def _op_update_begin(self, conn: int, request: dict[str, Any]) -> Reply:
        self._need("weights", "update_begin")
        assert self.weights is not None
        if self.buffer.writer == conn:
            raise RemoteError("conflict", "this connection already has an open update; commit or abort it")
        wait_s = min(max(float(request.get("timeout_s", _DEFAULT_UPDATE_WAIT_S)), 0.0), _MAX_UPDATE_WAIT_S)
        with anyio.move_on_after(wait_s):
            while not self.buffer.can_begin():
                await self._changed.wait()
        try:
            slot = self.buffer.begin(conn)
        except DoubleBufferConflictError as exc:
            raise UpdateBusyError("busy", f"{exc} (waited {wait_s:g} s)") from exc
        slot_bytes = self.weights.slot_bytes
        if request.get("copy_current", False):
            src = self.buffer.active_slot * slot_bytes
            await anyio.to_thread.run_sync(self.region.copy, src, slot * slot_bytes, slot_bytes)
        return {"slot": slot, "slot_offset": slot * slot_bytes, "next_version": self.buffer.version + 1}

    async def _op_update_commit(self, conn: int, request: dict[str, Any]) -> Reply:
        self._need("weights", "update_commit")
        version = self.buffer.commit(conn)
        self._notify()
        return {"version": version, "active_slot": self.buffer.active_slot}

    async def _op_update_abort(self, conn: int, request: dict[str, Any]) -> Reply:
        self._need("weights", "update_abort")
        self.buffer.abort(conn)
        self._notify()
        return {"version": self.buffer.version}
