"""IdleBuffer on the host backend: memory goes back to the OS while idle, the address stays."""

from __future__ import annotations

import re

import pytest

from belayer_gpumem import BackendUnavailableError, IdleBuffer

_SIZE = 64 * 1024 * 1024


def _resident_bytes(address: int) -> int:
    """Rss of the mapping that contains `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


def test_release_gives_memory_back_and_restore_keeps_the_address() -> None:
    buffer = IdleBuffer.allocate(_SIZE)
    address = buffer.tensor.data_ptr()
    assert buffer.resident
    assert buffer.nbytes == _SIZE
    buffer.tensor.fill_(7)
    assert _resident_bytes(address) >= _SIZE
    buffer.release()
    assert not buffer.resident
    assert _resident_bytes(address) < _SIZE // 8
    buffer.restore()
    assert buffer.resident
    assert buffer.tensor.data_ptr() == address
    assert _resident_bytes(address) >= _SIZE  # populated up front, not at first use
    assert int(buffer.tensor.sum()) == 0  # contents are not kept across release
    buffer.release()
    buffer.release()  # idempotent


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        IdleBuffer.allocate(4096, backend="tpu")
