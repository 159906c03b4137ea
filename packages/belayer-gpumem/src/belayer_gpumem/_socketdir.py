"""Private socket placement and peer credentials."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from pathlib import Path

from belayer_gpumem._errors import PermissionDeniedError, ServerStartError

__all__ = ["check_peer", "claim_socket_path", "peer_uid", "remove_quietly", "write_file_atomically"]

_UCRED = struct.Struct("3i")


def claim_socket_path(path: Path) -> None:
    """Make `path`'s directory private (0700, ours) and remove a stale socket left by a dead server.

    Raises ServerStartError if the directory is shared or another server answers on `path`.
    """
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) != 0o700:
        raise ServerStartError(
            f"socket directory {directory} must be owned by uid {os.geteuid()} with mode 0700 "
            f"(it has uid {info.st_uid}, mode {oct(stat.S_IMODE(info.st_mode))}); use a private directory"
        )
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ServerStartError(f"{path} exists and is not a socket; choose another --socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # a dead server's socket
        return
    finally:
        probe.close()
    raise ServerStartError(f"another server already listens on {path}; stop it or choose another path")


def peer_uid(sock: socket.socket) -> int:
    """The effective uid of the process on the other end (SO_PEERCRED, captured at connect time)."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


def check_peer(sock: socket.socket) -> None:
    """Raise PermissionDeniedError unless the peer runs as our own effective uid."""
    uid = peer_uid(sock)
    if uid != os.geteuid():
        raise PermissionDeniedError(f"peer uid {uid} is not the server's uid {os.geteuid()}")


def write_file_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def remove_quietly(path: Path | None) -> None:
    """Unlink `path` if it is there."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
