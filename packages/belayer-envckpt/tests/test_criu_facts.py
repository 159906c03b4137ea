"""CRIU's version against the kernel, runc's options, and reading CRIU's logs (no engine needed)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

from belayer_envckpt import CheckpointStore
from belayer_envckpt._criu import (
    describe_inet_socket,
    first_error_line,
    kernel_fit,
    kernel_release,
    log_named_in,
    parse_version,
    runc_conf_options,
    unrestorable_connection,
)
from belayer_envckpt._store import MAX_FAILED_LOGS


def test_criu_before_4_2_does_not_fit_kernels_from_6_16():
    assert parse_version("6.18.44-fc-v669") == (6, 18, 44)
    problem = kernel_fit("4.1.1", "6.18.44-fc-v669")
    assert problem is not None
    assert "4.2" in problem
    assert "setup-system" in problem
    assert kernel_fit("4.1.1", "6.15.2") is None
    assert kernel_fit("4.2.1", "6.18.44") is None
    assert kernel_fit("4.3", "7.0.1") is None
    assert "cannot read" in (kernel_fit("", "6.1") or "")


def test_runc_options_are_read_without_comments(tmp_path):
    conf = tmp_path / "runc.conf"
    conf.write_text("tcp-established\n# a comment\n\nfile-locks  # and a tail\n")
    assert runc_conf_options(conf) == {"tcp-established", "file-locks"}
    assert runc_conf_options(tmp_path / "absent.conf") == set()


def test_the_first_error_line_skips_what_criu_carries_on_from(tmp_path):
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.1) Dumping processes\n"
        "(00.2) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
        "(00.3) Warn  (criu/irmap.c:105): irmap: Can't stat /no-such-path\n"
        "(00.4) Error (criu/sk-inet.c:185): inet: In-flight connection (l) for 5b625\n"
        "(00.5) Error (criu/cr-dump.c:1975): Dumping FAILED.\n"
    )
    line = first_error_line(log)
    assert line.endswith("In-flight connection (l) for 5b625")
    assert unrestorable_connection(line) == 0x5B625
    assert unrestorable_connection("(00.1) Error (criu/sk-inet.c:1): Connected TCP socket, consider ...") == 0
    assert (
        unrestorable_connection("(00.1) Error (criu/fsnotify.c:284): fsnotify: Can't dump that handle")
        is None
    )
    assert first_error_line(tmp_path / "absent.log") == ""


def test_the_log_an_engine_error_names_is_found(tmp_path):
    log = tmp_path / "criu-dump.log"
    log.write_text("x")
    said = f"runc did not terminate successfully: exit status 1: criu failed: type NOTIFY errno 0 path= {log}: unknown"
    assert log_named_in(said) == log
    assert log_named_in(f"criu failed\nlog file: {log}") == log
    assert log_named_in(f"path= {tmp_path}/absent.log: unknown") is None
    assert log_named_in("no log here") is None


def test_a_socket_is_described_by_its_address():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        inode = os.fstat(listener.fileno()).st_ino
        assert describe_inet_socket(os.getpid(), inode) == f"tcp 127.0.0.1:{port} -> 0.0.0.0:0 (LISTEN)"
    assert describe_inet_socket(os.getpid(), 1) == "socket inode 1"


def test_failed_logs_are_bounded_and_removed_by_gc(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    log = tmp_path / "dump.log"
    log.write_text("(00.1) Error (x): y\n")
    kept = [store.keep_failed_log("t", f"k{i:05d}-x", log) for i in range(MAX_FAILED_LOGS + 3)]
    other = store.keep_failed_log("u", "k00000-y", log)
    assert len(store.failed_logs()) == MAX_FAILED_LOGS
    assert other in store.failed_logs("u")
    assert not kept[0].exists()  # the oldest went first
    assert kept[-1].read_text() == log.read_text()
    assert store.list() == []  # the failed area is not a trajectory
    assert set(store.gc("t")) == set(kept[-(MAX_FAILED_LOGS - 1) :])  # "u"'s log took one place
    assert store.failed_logs() == [other]
    store.gc()
    assert store.failed_logs() == []
    assert not (tmp_path / "store" / ".failed").exists()


def test_doctor_flags_a_criu_too_old_for_this_kernel(tmp_path):
    old = tmp_path / "criu"
    old.write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.1.1'; else echo 'Looks good.'; fi\n"
    )
    old.chmod(stat.S_IRWXU)
    proc = subprocess.run(
        [sys.executable, "-m", "belayer_envckpt", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BELAYER_CRIU": str(old)},
    )
    check = json.loads(proc.stdout)["checks"]["criu vs kernel"]
    expected = kernel_fit("4.1.1", kernel_release())
    assert check["ok"] is (expected is None)
    if expected is not None:
        assert proc.returncode == 3
        assert "Install CRIU >= 4.2" in check["detail"]
