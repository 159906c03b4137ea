"""Life cycle, failure and security behaviour of a real server process."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import KV_LAYOUT, start_worker, wait_line

from belayer_gpumem import (
    ExitCode,
    KVClient,
    ServerConfig,
    ServerGoneError,
    ServerProcess,
    ServerStartError,
    WeightClient,
    ping,
)
from belayer_gpumem._connection import Connection
from belayer_gpumem._protocol import HEADER, MAX_REQUEST_BYTES, encode_frame


def test_ready_file_pid_file_private_socket_and_clean_sigterm(run_dir: Path, tmp_path: Path) -> None:
    ready, pid = tmp_path / "ready.json", tmp_path / "server.pid"
    config = ServerConfig(
        kind="kv", socket=run_dir / "kv.sock", kv_layout=KV_LAYOUT, ready_file=ready, pid_file=pid
    )
    server = ServerProcess.start(config)
    assert json.loads(ready.read_text())["pid"] == server.pid == int(pid.read_text())
    assert server.ready_info["socket"] == str(config.socket)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(config.socket.stat().st_mode) == 0o600
    assert ping(config.socket)["pid"] == server.pid
    assert any("memfd:" in link for link in _fd_links(server.pid))
    assert server.stop() == ExitCode.INTERRUPTED  # stopped cleanly by SIGTERM (root README)
    assert not config.socket.exists()
    assert not ready.exists()
    assert not pid.exists()


def _death_signal_in_child() -> None:
    """A `preexec_fn`: SIGKILL the child when the thread that forked it ends (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)


def test_spawn_runs_preexec_fn_and_a_death_signal_set_there_follows_the_forking_thread(
    run_dir: Path,
) -> None:
    # A supervisor spawns a server (to record its pid before it is ready), then waits for it. A
    # parent-death signal set in `preexec_fn` fires when the forking *thread* ends, not the
    # process: a supervisor forks from a long-lived thread (belayer-shadow's `Spawner`).
    config = ServerConfig(kind="kv", socket=run_dir / "kv.sock", kv_layout=KV_LAYOUT)
    spawned: list[subprocess.Popen[str]] = []
    forker = threading.Thread(
        target=lambda: spawned.append(ServerProcess.spawn(config, preexec_fn=_death_signal_in_child))
    )
    forker.start()
    forker.join()
    (short_lived,) = spawned
    short_lived.communicate(timeout=60)
    assert short_lived.returncode == -signal.SIGKILL  # its forking thread ended: it went too
    popen = ServerProcess.spawn(config, preexec_fn=_death_signal_in_child)  # this thread lives on
    server = ServerProcess.wait_ready(config, popen)
    try:
        assert ping(config.socket)["pid"] == server.pid == popen.pid
    finally:
        assert server.stop() == ExitCode.INTERRUPTED


def test_server_killed_gives_a_typed_error_and_the_mapping_survives(weights_server: ServerProcess) -> None:
    client = start_worker("ping-after-server-death", str(weights_server.config.socket))
    wait_line(client, "ATTACHED")
    weights_server.kill()
    out, err = client.communicate("go\n", timeout=60)
    assert client.returncode == 0, err
    assert "GONE ServerGoneError" in out
    assert "STILL-READABLE True" in out
    with pytest.raises(ServerGoneError, match="no memory server listens"):
        WeightClient.attach(weights_server.config.socket)


def test_a_restarted_server_reclaims_the_stale_socket(kv_server: ServerProcess) -> None:
    kv_server.kill()
    assert kv_server.config.socket.exists()  # SIGKILL leaves the socket file behind
    with ServerProcess.start(kv_server.config) as again, KVClient.attach(again.config.socket) as kv:
        assert kv.generation == 0


def test_a_second_server_on_a_live_socket_is_refused(kv_server: ServerProcess) -> None:
    with pytest.raises(ServerStartError, match="already listens"):
        ServerProcess.start(kv_server.config, timeout_s=30)
    assert ping(kv_server.config.socket)["ok"]


def test_a_shared_socket_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ServerStartError, match="mode 0700"):
        ServerProcess.start(ServerConfig(kind="kv", socket=shared / "kv.sock", kv_layout=KV_LAYOUT))


def _fd_links(pid: int) -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return links


def _raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    return sock


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "bad_request"),
        (b"[]", "bad_request"),
        (b"", "bad_request"),
        (json.dumps({"op": "format_disk"}).encode(), "bad_request"),
        (json.dumps({"op": "update_begin", "timeout_s": "soon"}).encode(), "bad_request"),
        (json.dumps({"op": "flush"}).encode(), "wrong_kind"),
        (json.dumps({"op": "update_commit"}).encode(), "conflict"),
    ],
)
def test_malformed_requests_get_error_replies_and_the_connection_lives_on(
    weights_server: ServerProcess, body: bytes, code: str
) -> None:
    conn = Connection.connect(weights_server.config.socket)
    reply, _ = conn.exchange(HEADER.pack(len(body)) + body)
    assert reply["ok"] is False
    assert reply["error"]["code"] == code
    again, _ = conn.exchange(encode_frame({"op": "ping"}))
    assert again["ok"] is True
    conn.close()


def test_an_oversized_request_is_refused_without_reading_it(weights_server: ServerProcess) -> None:
    conn = Connection.connect(weights_server.config.socket)
    reply, _ = conn.exchange(HEADER.pack(MAX_REQUEST_BYTES + 1) + b"x" * 1024)
    assert reply["error"]["code"] == "too_large"
    with pytest.raises(ServerGoneError):
        conn.exchange(encode_frame({"op": "ping"}))  # the server closed that connection
    huge = _raw(weights_server.config.socket)
    huge.sendall(struct.pack(">I", 2**32 - 1))
    assert b"too_large" in huge.recv(4096)
    huge.close()
    truncated = _raw(weights_server.config.socket)
    truncated.sendall(HEADER.pack(100) + b"{")
    truncated.close()  # a peer that hangs up mid-frame must not hurt the server
    assert ping(weights_server.config.socket)["ok"]


# Everything is imported before dropping root: as nobody, the interpreter's own files may be unreadable.
_PREAMBLE = """
import ctypes, os, sys
import belayer_gpumem._backends.host
from belayer_gpumem import PermissionDeniedError, WeightClient
"""
_ATTACH = """
try:
    WeightClient.attach(sys.argv[1])
except PermissionDeniedError as exc:
    print("REFUSED", exc)
else:
    print("ATTACHED")
"""
_CAPSET = (
    _PREAMBLE
    + """
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_KEEPCAPS = 8
assert libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) == 0
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
# Keep only CAP_DAC_OVERRIDE | CAP_DAC_READ_SEARCH, effective: the file-system checks pass,
# so only the server's SO_PEERCRED check stands between this uid and the region.
header = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)(0b110, 0b110, 0, 0, 0, 0)
if libc.syscall(126, header, data) != 0:  # capset
    print("NOCAPS"); sys.exit(0)
"""
    + _ATTACH
)


def _as_nobody(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_is_refused_by_the_socket_permissions(weights_server: ServerProcess) -> None:
    code = _PREAMBLE + "os.setresgid(65534, 65534, 65534)\nos.setresuid(65534, 65534, 65534)\n" + _ATTACH
    out = _as_nobody(code, str(weights_server.config.socket))
    assert out.startswith("REFUSED"), out


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_is_refused_by_the_peer_credential_check(weights_server: ServerProcess) -> None:
    out = _as_nobody(_CAPSET, str(weights_server.config.socket))
    if out.startswith("NOCAPS"):
        pytest.skip("this container cannot keep CAP_DAC_OVERRIDE across setuid")
    assert out.startswith("REFUSED"), out
    assert "peer uid 65534" in out
    assert ping(weights_server.config.socket)["ok"]


def test_sigterm_with_attached_clients_still_exits_cleanly(kv_server: ServerProcess) -> None:
    kv = KVClient.attach(kv_server.config.socket)
    kv.arena.fill_(1.0)
    kv_server.popen.send_signal(signal.SIGTERM)
    assert kv_server.popen.wait(timeout=30) == ExitCode.INTERRUPTED
    assert float(kv.arena[0, 0, 0].double().sum()) > 0  # our own mapping outlives the server
    with pytest.raises(ServerGoneError):
        kv.flush()
    kv.detach()
