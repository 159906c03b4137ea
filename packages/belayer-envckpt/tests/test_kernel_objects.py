"""Issue 21's table: each kernel object checkpointed, the container killed, restored, and used.

One sandbox holds every object (tests/kernel_agent.py sets them up and answers probes), so the
suite pays for one checkpoint and one restore; each object is then probed in a test of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DEBIAN, TEST_LABELS, wait_for

from belayer_envckpt import (
    CheckpointFailedError,
    CheckpointStore,
    Engine,
    Sandbox,
    SandboxConfig,
    UnrestorableConnectionError,
    full_checkpoint,
    full_restore,
)

AGENT = (Path(__file__).parent / "kernel_agent.py").read_text()
PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(90)
s.connect("/run/agent.sock")
s.sendall(sys.argv[1].encode())
reply = b""
while chunk := s.recv(4096):
    reply += chunk
print(reply.decode())
"""
# The README's table follows this order.
OBJECTS = [
    "tcp_listen",
    "tcp_established",
    "tcp_half_closed",
    "unix_stream",
    "unix_dgram",
    "socketpair",
    "pipe",
    "fifo",
    "eventfd",
    "timerfd",
    "signalfd",
    "epoll",
    "inotify",
    "memfd",
    "shared_memory",
    "deleted_file",
    "itimer",
    "thread",
    "session",
    "process_group",
    "zombie",
    "file_locks",
]


def probe(sandbox: Sandbox, name: str) -> str:
    return sandbox.probe(["python3", "-c", PROBE, name], timeout_s=120).stdout.strip()


def start(engine: Engine, app: str, trajectory: str) -> Sandbox:
    config = SandboxConfig(image=DEBIAN, command=("python3", "-c", app), labels=TEST_LABELS)
    return Sandbox.create(engine, config, trajectory=trajectory)


@pytest.fixture(scope="module")
def restored(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """The agent's sandbox, checkpointed with every object set up, killed, and restored."""
    store = CheckpointStore(tmp_path_factory.mktemp("objects"))
    sandbox = start(engine, AGENT, "objects")
    back: Sandbox | None = None
    try:
        wait_for(lambda: probe(sandbox, "ready") == "ok set up", timeout=120)
        checkpoint = full_checkpoint(sandbox, "objects", store=store)
        sandbox.kill()
        back = full_restore(checkpoint, engine=engine)
        assert back.id != sandbox.id
        yield back
    finally:
        sandbox.remove()
        if back is not None:
            back.remove()


@pytest.mark.parametrize("name", OBJECTS)
def test_the_restored_process_still_uses_it(restored: Sandbox, name: str) -> None:
    reply = probe(restored, name)
    assert reply.startswith("ok "), reply


# A connection still in a listener's accept queue: CRIU cannot bring it back.
IN_FLIGHT = """
import socket, time
listener = socket.socket()
listener.bind(("127.0.0.1", 7001))
listener.listen(4)
client = socket.create_connection(("127.0.0.1", 7001))
open("/tmp/ready", "w").close()
time.sleep(100000)
"""

# An inotify watch on a directory CRIU cannot find again (see the README): outside its search
# paths (its own hints and those setup-system adds), and overlayfs cannot reopen a file handle.
INOTIFY_ELSEWHERE = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("/var/lib/watched")
fd = libc.inotify_init1(0)
assert libc.inotify_add_watch(fd, b"/var/lib/watched", 0x100) >= 0
open("/tmp/ready", "w").close()
time.sleep(100000)
"""


@pytest.mark.parametrize("dump_method", ["runc", "engine"])
def test_a_connection_that_cannot_be_restored_is_named_and_the_log_kept(tmp_path, dump_method):
    # runc leaves CRIU's log in the partial checkpoint; the engine names its own copy in its error.
    store = CheckpointStore(tmp_path)
    engine = Engine.connect(dump_method=dump_method)
    sandbox = start(engine, IN_FLIGHT, "inflight")
    try:
        wait_for(lambda: sandbox.probe("test -e /tmp/ready").ok, timeout=120)
        with pytest.raises(UnrestorableConnectionError, match=r"listener tcp 127\.0\.0\.1:7001") as caught:
            full_checkpoint(sandbox, "inflight", store=store)
        log = caught.value.log_path
        assert log is not None
        assert str(log) in str(caught.value)
        assert "In-flight connection" in log.read_text()
        assert store.failed_logs("inflight") == [log]
        assert store.list("inflight") == []  # nothing torn was published
        assert sandbox.is_running()  # and the sandbox runs on
        assert log in store.gc("inflight")
        assert not log.exists()
    finally:
        sandbox.remove()
        engine.close()


def test_a_failed_dump_quotes_criu_first_error(engine, tmp_path):
    store = CheckpointStore(tmp_path)
    sandbox = start(engine, INOTIFY_ELSEWHERE, "inotify")
    try:
        wait_for(lambda: sandbox.probe("test -e /tmp/ready").ok, timeout=120)
        with pytest.raises(CheckpointFailedError, match="fsnotify") as caught:
            full_checkpoint(sandbox, "inotify", store=store)
        assert not isinstance(caught.value, UnrestorableConnectionError)
        assert caught.value.log_path is not None
        assert caught.value.log_path.parent == tmp_path / ".failed" / "inotify"
        assert sandbox.is_running()
    finally:
        sandbox.remove()
