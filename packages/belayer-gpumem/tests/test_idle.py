"""IdleBuffer on the host backend: memory goes back to the OS while idle, the address stays."""

from __future__ import annotations

import pytest
from conftest import resident_bytes

from belayer_gpumem import BackendUnavailableError, IdleBuffer

_SIZE = 64 * 1024 * 1024


def test_release_gives_memory_back_and_restore_keeps_the_address() -> None:
    buffer = IdleBuffer.allocate(_SIZE)
    address = buffer.tensor.data_ptr()
    assert buffer.resident
    assert buffer.nbytes == _SIZE
    buffer.tensor.fill_(7)
    assert resident_bytes(address) >= _SIZE
    buffer.release()
    assert not buffer.resident
    assert resident_bytes(address) < _SIZE // 8
    buffer.restore()
    assert buffer.resident
    assert buffer.tensor.data_ptr() == address
    assert resident_bytes(address) >= _SIZE  # populated up front, not at first use
    assert int(buffer.tensor.sum()) == 0  # contents are not kept across release
    buffer.release()
    buffer.release()  # idempotent


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        IdleBuffer.allocate(4096, backend="tpu")
