"""Attaching to memory servers: zero-copy torch views of the weight table and the KV arena.

    weights = WeightClient.attach("/run/belayer/weights.sock")
    params = weights.tensors()          # {name: Tensor}, views into the live slot
    weights.refresh()                   # after an update: True if the version moved; re-read tensors()

    kv = KVClient.attach("/run/belayer/kv.sock")
    k_cache, v_cache = kv.layer(0)      # (num_blocks, block_size, num_kv_heads, head_dim) each

The mapping belongs to this process: it stays valid when another client dies, and even when the
server dies (then every call that talks to the server raises ServerGoneError).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Self

import attrs
import torch

from belayer_gpumem._backends import map_region
from belayer_gpumem._connection import Connection
from belayer_gpumem._errors import BelayerGpumemError, ServerStartError
from belayer_gpumem._layout import KVLayout, WeightLayout

__all__ = ["KVClient", "WeightClient", "WeightUpdate", "ping"]


def ping(socket_path: str | Path, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """Liveness: the server's reply (kind, pid, uptime_s); raises ServerGoneError if it is not there."""
    conn = Connection.connect(socket_path, timeout_s=timeout_s)
    try:
        reply, _ = conn.request("ping")
        return reply
    finally:
        conn.close()


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _view(flat: torch.Tensor, start: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return flat[start : start + nbytes].view(_torch_dtype(dtype)).view(shape)


@attrs.define
class _Attachment:
    """A connection plus this process's mapping of the region."""

    conn: Connection
    info: dict[str, Any]
    flat: torch.Tensor | None

    @classmethod
    def open(cls, socket_path: str | Path, kind: str, timeout_s: float, populate: bool) -> _Attachment:
        conn = Connection.connect(socket_path, timeout_s=timeout_s)
        try:
            info, _ = conn.request("describe")
            if info.get("kind") != kind:
                raise ServerStartError(f"{socket_path} serves {info.get('kind')!r}, not {kind!r}")
            reply, fds = conn.request("open")
            if len(fds) != 1:
                raise BelayerGpumemError(f"expected one region fd from the server, got {len(fds)}")
            flat = map_region(
                reply["backend"],
                fds[0],
                int(reply["region_bytes"]),
                device=int(reply["device"]),
                populate=populate,
            )
        except BaseException:
            conn.close()
            raise
        return cls(conn=conn, info=info, flat=flat)

    def region(self) -> torch.Tensor:
        if self.flat is None:
            raise BelayerGpumemError("this client was detached; attach again")
        return self.flat

    def detach(self) -> None:
        self.conn.close()
        self.flat = None


class _ClientBase:
    _att: _Attachment

    def ping(self) -> dict[str, Any]:
        """Liveness over this client's connection; raises ServerGoneError if the server is gone."""
        reply, _ = self._att.conn.request("ping")
        return reply

    def describe(self) -> dict[str, Any]:
        """The server's layout, counters, backend and pid."""
        reply, _ = self._att.conn.request("describe")
        return reply

    def health(self) -> dict[str, Any]:
        """Ask the server to check its device (a tiny kernel on cuda); raises RemoteError if unhealthy."""
        reply, _ = self._att.conn.request("health")
        return reply

    @property
    def backend(self) -> str:
        """`host` or `cuda`."""
        return str(self._att.info["backend"])

    @property
    def region(self) -> torch.Tensor:
        """The whole region as a flat uint8 tensor."""
        return self._att.region()

    def detach(self) -> None:
        """Close the connection and drop this client's views; the memory stays for everyone else.

        The mapping itself goes away once the last tensor view of it is garbage.
        """
        self._att.detach()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


class WeightClient(_ClientBase):
    """A reader (and possibly writer) of a weight server's double-buffered table."""

    def __init__(self, attachment: _Attachment) -> None:
        self._att = attachment
        self.layout = WeightLayout.from_json(attachment.info["layout"])
        self._version = -1
        self._slot_offset = 0
        self._tensors: dict[str, torch.Tensor] | None = None

    @classmethod
    def attach(
        cls, socket_path: str | Path, *, timeout_s: float = 30.0, populate: bool = False
    ) -> WeightClient:
        """Connect, map the region and pin the live version.

        `populate` pays for mapping every page now (host backend), e.g. while a shadow stands by,
        so that the first forward pass after a handover does not.
        """
        client = cls(_Attachment.open(socket_path, "weights", timeout_s, populate))
        try:
            client.refresh()
        except BaseException:
            client.detach()
            raise
        return client

    @property
    def version(self) -> int:
        """The version this client's tensors show (0: never written)."""
        return self._version

    def latest_version(self) -> int:
        """The server's current version (may be newer than `version`)."""
        return int(self.describe()["version"])

    def refresh(self) -> bool:
        """Move to the latest version; True if it changed (then call tensors() again for the new views).

        Until it is called, the tensors of the pinned version stay unchanged, and a writer waits
        before it reuses their slot.
        """
        reply, _ = self._att.conn.request("acquire")
        changed = int(reply["version"]) != self._version
        self._version = int(reply["version"])
        if self._slot_offset != int(reply["slot_offset"]) or self._tensors is None:
            self._slot_offset = int(reply["slot_offset"])
            self._tensors = None
        return changed

    def release(self) -> None:
        """Drop this client's pin, so that no weight update waits for it (an idle standby reader).

        The views stay mapped but may change under a later update: call `refresh()` before
        reading `tensors()` again.
        """
        self._att.conn.request("release")

    def tensors(self) -> dict[str, torch.Tensor]:
        """{name: tensor} views of the pinned version, zero copy."""
        if self._tensors is None:
            self._tensors = self._views(self._slot_offset)
        return dict(self._tensors)

    def fused_tensors(self) -> dict[str, torch.Tensor]:
        """{merged name: tensor} of the pinned version: one view over each merged tensor's parts
        (the layout's `fused`), zero copy; empty when the layout merges nothing."""
        flat = self.region
        specs = [self.layout.fused_spec(group.name) for group in self.layout.fused]
        return {s.name: _view(flat, self._slot_offset + s.offset, s.nbytes, s.dtype, s.shape) for s in specs}

    def _views(self, slot_offset: int) -> dict[str, torch.Tensor]:
        flat = self.region
        return {
            t.name: _view(flat, slot_offset + t.offset, t.nbytes, t.dtype, t.shape)
            for t in self.layout.tensors
        }

    def update(self, *, copy_current: bool = False, timeout_s: float = 30.0) -> WeightUpdate:
        """Open a weight update (waits up to `timeout_s` for readers of the old slot to refresh).

        Write the new values into `update.tensors()`, then commit (or leave the `with` block).
        With `copy_current`, the server first copies the live weights, for partial updates.
        Raises UpdateBusyError if the update cannot begin in time.
        """
        reply, _ = self._att.conn.request("update_begin", copy_current=copy_current, timeout_s=timeout_s)
        return WeightUpdate(
            client=self, slot_offset=int(reply["slot_offset"]), views=self._views(reply["slot_offset"])
        )

    def _commit(self) -> int:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.region.device)  # our writes must land before others see them
        reply, _ = self._att.conn.request("update_commit")
        self.refresh()
        return int(reply["version"])

    def _abort(self) -> None:
        self._att.conn.request("update_abort")

    def detach(self) -> None:
        """Close the connection and drop this client's views."""
        self._tensors = None
        super().detach()


@attrs.define
class WeightUpdate:
    """An open weight update: write `tensors()`, then `commit()` publishes them atomically."""

    client: WeightClient
    slot_offset: int
    views: dict[str, torch.Tensor]
    done: bool = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """{name: tensor} views of the slot being written (invisible to readers until commit)."""
        return dict(self.views)

    def commit(self) -> int:
        """Publish: readers that refresh() now see the new weights. Returns the new version."""
        self.done = True
        return self.client._commit()

    def abort(self) -> None:
        """Give up; readers keep the current version."""
        self.done = True
        self.client._abort()

    def __enter__(self) -> WeightUpdate:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: TracebackType | None) -> None:
        if self.done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class KVClient(_ClientBase):
    """A view of a KV server's paged arena."""

    def __init__(self, attachment: _Attachment) -> None:
        self._att = attachment
        self.layout = KVLayout.from_json(attachment.info["layout"])
        self._generation = int(attachment.info["generation"])
        self._arena: torch.Tensor | None = None

    @classmethod
    def attach(cls, socket_path: str | Path, *, timeout_s: float = 30.0, populate: bool = False) -> KVClient:
        """Connect and map the arena (`populate`: as for WeightClient.attach)."""
        return cls(_Attachment.open(socket_path, "kv", timeout_s, populate))

    @property
    def arena(self) -> torch.Tensor:
        """The arena: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), zero copy."""
        if self._arena is None:
            kv = self.layout
            self._arena = _view(self.region, 0, kv.nbytes, kv.dtype, kv.shape)
        return self._arena

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each (num_blocks, block_size, num_kv_heads, head_dim), contiguous."""
        return self.arena[index, 0], self.arena[index, 1]

    @property
    def generation(self) -> int:
        """How many flushes this client has seen (block tables from an older generation are void)."""
        return self._generation

    def flush(self) -> int:
        """Zero the whole arena for every client and bump the generation; returns the new generation."""
        reply, _ = self._att.conn.request("flush")
        self._generation = int(reply["generation"])
        return self._generation

    def detach(self) -> None:
        """Close the connection and drop this client's views."""
        self._arena = None
        super().detach()
