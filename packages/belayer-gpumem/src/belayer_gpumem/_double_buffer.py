"""Bookkeeping of the weight double buffer: which half is live, who reads which, who writes.

The two halves are called *slots* on the wire (`active_slot`, `slot_bytes`, `update_begin`'s
`slot`): not to be confused with the engine slots of belayer-shadow and belayer-router.

Readers *pin* the slot of the version they use; a writer gets the other slot only once no reader
pins it, fills it, and *commit* flips the live slot and bumps the version. So no reader ever sees a
slot that is being written: the atomicity of a weight update rests on this table alone.
"""

from __future__ import annotations

import attrs

from belayer_gpumem._errors import BelayerGpumemError

__all__ = ["DoubleBufferConflictError", "WeightDoubleBuffer"]


class DoubleBufferConflictError(BelayerGpumemError):
    """A slot operation is not allowed in the current state (no update open, another writer, ...)."""


@attrs.define
class WeightDoubleBuffer:
    """The state machine behind `acquire`, `release` and `update_begin/commit/abort`.

    Connection ids are opaque ints chosen by the server; `disconnect` undoes everything a
    connection held, so a client that dies never blocks writers nor publishes a partial update.
    """

    active_slot: int = 0
    version: int = 0
    pins: dict[int, int] = attrs.field(factory=dict)  # connection id -> pinned slot
    writer: int | None = None

    @property
    def inactive_slot(self) -> int:
        """The slot the next update writes."""
        return 1 - self.active_slot

    def pin(self, conn: int) -> tuple[int, int]:
        """Pin `conn` to the live slot (moving any older pin); returns (slot, version)."""
        self.pins[conn] = self.active_slot
        return self.active_slot, self.version

    def unpin(self, conn: int) -> None:
        """Drop `conn`'s pin, if any."""
        self.pins.pop(conn, None)

    def readers_of(self, slot: int) -> int:
        """Number of connections pinning `slot`."""
        return sum(1 for pinned in self.pins.values() if pinned == slot)

    def can_begin(self) -> bool:
        """True when no writer is active and nobody pins the inactive slot."""
        return self.writer is None and self.readers_of(self.inactive_slot) == 0

    def begin(self, conn: int) -> int:
        """Make `conn` the writer of the inactive slot; returns that slot."""
        if self.writer is not None:
            raise DoubleBufferConflictError(
                f"another client (connection {self.writer}) is already updating the weights"
            )
        waiting = self.readers_of(self.inactive_slot)
        if waiting:
            raise DoubleBufferConflictError(
                f"{waiting} reader(s) still use version {self.version - 1}; they must call refresh() first"
            )
        self.writer = conn
        return self.inactive_slot

    def commit(self, conn: int) -> int:
        """Publish the written slot: it becomes live and the version goes up; returns the new version."""
        self._check_writer(conn)
        self.active_slot = self.inactive_slot
        self.version += 1
        self.writer = None
        return self.version

    def abort(self, conn: int) -> None:
        """Give the update up; the live slot and version stay as they were."""
        self._check_writer(conn)
        self.writer = None

    def disconnect(self, conn: int) -> None:
        """Forget everything `conn` held: its pin, and its update (aborted, never published)."""
        self.unpin(conn)
        if self.writer == conn:
            self.writer = None

    def _check_writer(self, conn: int) -> None:
        if self.writer != conn:
            raise DoubleBufferConflictError(
                "this connection has no open weight update; call update_begin first"
            )
