"""A process that holds one of each kernel object of issue 21 and answers probes about them.

It runs inside a belayer/debian-python sandbox (`python3 -c <this source>`).  At start it sets up
every object, leaving some data in flight (queued on sockets and pipes, an eventfd count, a
pending signal) so that a restore has to carry it.  It then serves probes on a unix stream socket,
``/run/agent.sock``: a client sends an object's name and gets back ``ok <detail>`` when the agent
could USE the object right now (send and receive through it, read the in-flight data, ...) or
``fail <detail>``.  `PROBE_CLIENT` is the client, run with `Sandbox.probe`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import select
import signal
import socket
import struct
import threading
import time

LIBC = ctypes.CDLL(None, use_errno=True)
CONTROL = "/run/agent.sock"
IN_CREATE = 0x100
CLOCK_MONOTONIC = 1


def check(condition, detail):
    if not condition:
        raise AssertionError(detail)
    return detail


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AssertionError(f"peer closed after {data!r}")
        data += chunk
    return data


def read_exact(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise AssertionError(f"EOF after {data!r}")
        data += chunk
    return data


class Agent:
    """Holds the objects; `probe_<name>` uses one and returns a detail string."""

    def __init__(self):
        # Blocked in every thread (they inherit it), so that SIGUSR1 waits for the signalfd.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        self.first = {}  # per object: whether the in-flight data was already consumed
        self.ticks = 0
        self.thread_ticks = 0
        # TCP on loopback: a listener, and an established connection to it with data queued.
        self.tcp_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp_listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp_listener.bind(("127.0.0.1", 7000))
        self.tcp_listener.listen(8)
        self.tcp_client = socket.create_connection(("127.0.0.1", 7000))
        self.tcp_server, _ = self.tcp_listener.accept()
        self.tcp_client.sendall(b"queued-tcp")
        # A half-closed connection: the client sent its last bytes and shut its side down.
        self.half_client = socket.create_connection(("127.0.0.1", 7000))
        self.half_server, _ = self.tcp_listener.accept()
        self.half_client.sendall(b"last-words")
        self.half_client.shutdown(socket.SHUT_WR)
        threading.Thread(target=self.serve_tcp, daemon=True).start()
        # unix stream listener + a connection through its path; a datagram socket; a socket pair.
        self.unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix_listener.bind("/run/stream.sock")
        self.unix_listener.listen(4)
        self.unix_client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix_client.connect("/run/stream.sock")
        self.unix_server, _ = self.unix_listener.accept()
        self.unix_client.sendall(b"queued-ustream")
        self.dgram_server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.dgram_server.bind("/run/dgram.sock")
        self.dgram_client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.dgram_client.sendto(b"queued-dgram", "/run/dgram.sock")
        self.pair_a, self.pair_b = socket.socketpair()
        self.pair_a.sendall(b"queued-pair")
        # A pipe and a FIFO, each with data queued.
        self.pipe_r, self.pipe_w = os.pipe()
        os.write(self.pipe_w, b"queued-pipe")
        os.mkfifo("/run/fifo")
        self.fifo_r = os.open("/run/fifo", os.O_RDONLY | os.O_NONBLOCK)
        self.fifo_w = os.open("/run/fifo", os.O_WRONLY)
        os.set_blocking(self.fifo_r, True)
        os.write(self.fifo_w, b"queued-fifo")
        # eventfd with a count; timerfd armed every 50 ms; signalfd with a pending SIGUSR1.
        self.efd = os.eventfd(0)
        os.eventfd_write(self.efd, 42)
        self.tfd = LIBC.timerfd_create(CLOCK_MONOTONIC, 0)
        spec = struct.pack("llll", 0, 50_000_000, 0, 50_000_000)  # interval, value: 50 ms
        check(LIBC.timerfd_settime(self.tfd, 0, spec, None) == 0, "timerfd_settime")
        mask = struct.pack("Q", 1 << (signal.SIGUSR1 - 1))
        self.sfd = LIBC.signalfd(-1, mask, 0)
        check(self.sfd >= 0, "signalfd")
        os.kill(os.getpid(), signal.SIGUSR1)  # pending: consumed by the first probe
        # epoll watching an eventfd of its own.
        self.ep_efd = os.eventfd(0)
        self.ep = select.epoll()
        self.ep.register(self.ep_efd, select.EPOLLIN)
        # inotify on a directory.
        os.makedirs("/workspace/watched", exist_ok=True)
        self.ifd = LIBC.inotify_init1(0)
        check(LIBC.inotify_add_watch(self.ifd, b"/workspace/watched", IN_CREATE) >= 0, "inotify_add_watch")
        # memfd, mapped shared; anonymous shared memory with a child that echoes slot 0 to slot 1.
        self.mfd = os.memfd_create("belayer")
        os.write(self.mfd, b"memfd-content".ljust(4096, b"\0"))
        self.mmap_memfd = mmap.mmap(self.mfd, 4096)
        self.shared = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.echo_child = os.fork()
        if self.echo_child == 0:
            while True:
                self.shared[8:16] = self.shared[0:8]
                time.sleep(0.01)
        # A deleted-but-open file.
        self.deleted = open("/tmp/deleted.txt", "w+")  # noqa: SIM115 (held open on purpose)
        self.deleted.write("deleted-content")
        self.deleted.flush()
        os.unlink("/tmp/deleted.txt")
        # An interval timer and a thread, each counting.
        signal.signal(signal.SIGALRM, self.on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        threading.Thread(target=self.count, daemon=True).start()
        # A child in its own session and one in its own process group; each reports SIGUSR2
        # (sent to its group) through a pipe.
        self.sess_r, sess_w = os.pipe()
        self.session_child = self.spawn_signalled(sess_w, new_session=True)
        self.pgrp_r, pgrp_w = os.pipe()
        self.group_child = self.spawn_signalled(pgrp_w, new_session=False)
        # A zombie: a child that exits with 7 and is not reaped.
        self.zombie = os.fork()
        if self.zombie == 0:
            os._exit(7)
        # File locks: an flock and a POSIX lock, held by this process.
        self.flock_file = open("/tmp/flock", "w")  # noqa: SIM115
        fcntl.flock(self.flock_file, fcntl.LOCK_EX)
        self.posix_file = open("/tmp/posixlock", "w")  # noqa: SIM115
        fcntl.lockf(self.posix_file, fcntl.LOCK_EX)

    def spawn_signalled(self, report_fd, new_session):
        pid = os.fork()
        if pid == 0:
            if new_session:
                os.setsid()
            else:
                os.setpgid(0, 0)
            signal.signal(signal.SIGUSR2, lambda *_: os.write(report_fd, b"U"))
            while True:
                time.sleep(3600)
        os.close(report_fd)
        return pid

    def on_alarm(self, *_):
        self.ticks += 1

    def count(self):
        while True:
            self.thread_ticks += 1
            time.sleep(0.01)

    def serve_tcp(self):
        while True:
            conn, _ = self.tcp_listener.accept()
            with conn:
                conn.sendall(b"pong:" + conn.recv(64))

    def once(self, name, queued_check):
        """Run ``queued_check`` (which reads in-flight data) only on the first probe of ``name``."""
        if not self.first.get(name):
            self.first[name] = True
            return queued_check()
        return "no queued data left"

    # -- probes -----------------------------------------------------------------------------

    def probe_ready(self):
        return "set up"

    def probe_tcp_listen(self):
        with socket.create_connection(("127.0.0.1", 7000), timeout=10) as conn:
            conn.sendall(b"ping")
            return check(recv_exact(conn, 9) == b"pong:ping", "accepted a new connection, answered")

    def probe_tcp_established(self):
        queued = self.once("tcp", lambda: recv_exact(self.tcp_server, 10).decode())
        self.tcp_server.sendall(b"back")
        check(recv_exact(self.tcp_client, 4) == b"back", "server -> client")
        self.tcp_client.sendall(b"forth")
        check(recv_exact(self.tcp_server, 5) == b"forth", "client -> server")
        return f"both directions; queued: {queued}"

    def probe_tcp_half_closed(self):
        def until_eof():
            data = b""
            while chunk := self.half_server.recv(64):
                data += chunk
            return data.decode()

        queued = self.once("half", until_eof)
        check(self.half_server.recv(64) == b"", "the client's side stays shut")
        self.half_server.sendall(b"answer")
        check(recv_exact(self.half_client, 6) == b"answer", "server -> client still open")
        return f"read to EOF: {queued}; the other direction still carries data"

    def probe_unix_stream(self):
        queued = self.once("ustream", lambda: recv_exact(self.unix_server, 14).decode())
        self.unix_server.sendall(b"x")
        check(recv_exact(self.unix_client, 1) == b"x", "server -> client")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
            extra.connect("/run/stream.sock")
            conn, _ = self.unix_listener.accept()
            with conn:
                extra.sendall(b"new")
                check(recv_exact(conn, 3) == b"new", "a new connection through the listener")
        return f"connection and listener; queued: {queued}"

    def probe_unix_dgram(self):
        queued = self.once("dgram", lambda: self.dgram_server.recv(64).decode())
        self.dgram_client.sendto(b"again", "/run/dgram.sock")
        check(self.dgram_server.recv(64) == b"again", "datagram")
        return f"datagrams; queued: {queued}"

    def probe_socketpair(self):
        queued = self.once("pair", lambda: recv_exact(self.pair_b, 11).decode())
        self.pair_b.sendall(b"y")
        check(recv_exact(self.pair_a, 1) == b"y", "b -> a")
        return f"both ends; queued: {queued}"

    def probe_pipe(self):
        queued = self.once("pipe", lambda: read_exact(self.pipe_r, 11).decode())
        os.write(self.pipe_w, b"z")
        check(read_exact(self.pipe_r, 1) == b"z", "pipe")
        return f"queued: {queued}"

    def probe_fifo(self):
        queued = self.once("fifo", lambda: read_exact(self.fifo_r, 11).decode())
        os.write(self.fifo_w, b"f")
        check(read_exact(self.fifo_r, 1) == b"f", "fifo")
        return f"queued: {queued}"

    def probe_eventfd(self):
        queued = self.once("efd", lambda: str(check(os.eventfd_read(self.efd) == 42, 42)))
        os.eventfd_write(self.efd, 5)
        check(os.eventfd_read(self.efd) == 5, "count")
        return f"count queued: {queued}"

    def probe_timerfd(self):
        expirations = struct.unpack("Q", read_exact(self.tfd, 8))[0]
        return check(expirations >= 1, f"{expirations} expirations")

    def probe_signalfd(self):
        def pending():
            info = read_exact(self.sfd, 128)
            return str(check(struct.unpack("I", info[:4])[0] == signal.SIGUSR1, "SIGUSR1"))

        queued = self.once("sfd", pending)
        os.kill(os.getpid(), signal.SIGUSR1)
        check(struct.unpack("I", read_exact(self.sfd, 128)[:4])[0] == signal.SIGUSR1, "new signal")
        return f"pending signal: {queued}"

    def probe_epoll(self):
        check(self.ep.poll(0) == [], "quiet before")
        os.eventfd_write(self.ep_efd, 1)
        check(self.ep.poll(10) == [(self.ep_efd, select.EPOLLIN)], "readable")
        os.eventfd_read(self.ep_efd)
        return "event delivered"

    def probe_inotify(self):
        name = f"f{time.monotonic_ns()}"
        open(f"/workspace/watched/{name}", "w").close()
        os.set_blocking(self.ifd, True)
        event = os.read(self.ifd, 4096)
        _wd, mask, _cookie, length = struct.unpack("iIII", event[:16])
        check(mask & IN_CREATE and event[16 : 16 + length].rstrip(b"\0").decode() == name, "IN_CREATE")
        return f"IN_CREATE {name}"

    def probe_memfd(self):
        check(self.mmap_memfd[:13] == b"memfd-content", "content")
        self.mmap_memfd[:13] = b"MEMFD-CONTENT"
        check(os.pread(self.mfd, 13, 0) == b"MEMFD-CONTENT", "write through the map, read the fd")
        self.mmap_memfd[:13] = b"memfd-content"
        return "map and fd agree"

    def probe_shared_memory(self):
        value = struct.pack("q", time.monotonic_ns())
        self.shared[0:8] = value
        deadline = time.monotonic() + 30
        while self.shared[8:16] != value:
            check(time.monotonic() < deadline, "the child did not echo")
            time.sleep(0.01)
        return "the child echoed through shared memory"

    def probe_deleted_file(self):
        self.deleted.seek(0)
        check(self.deleted.read() == "deleted-content", "content")
        check(os.fstat(self.deleted.fileno()).st_nlink == 0, "still unlinked")
        return "content readable, still unlinked"

    def wait_grows(self, read, what):
        start, deadline = read(), time.monotonic() + 30
        while read() <= start:
            check(time.monotonic() < deadline, f"{what} stopped")
            time.sleep(0.01)
        return f"{what} went on from {start}"

    def probe_itimer(self):
        return self.wait_grows(lambda: self.ticks, "SIGALRM ticks")

    def probe_thread(self):
        return self.wait_grows(lambda: self.thread_ticks, "thread counter")

    def signal_group(self, pid, report_fd, session):
        check((os.getsid(pid) if session else os.getpgid(pid)) == pid, "leads its own session/group")
        os.killpg(os.getpgid(pid), signal.SIGUSR2)
        check(read_exact(report_fd, 1) == b"U", "the child got the group's signal")
        return f"pid {pid} leads its {'session' if session else 'group'}; killpg reached it"

    def probe_session(self):
        return self.signal_group(self.session_child, self.sess_r, True)

    def probe_process_group(self):
        return self.signal_group(self.group_child, self.pgrp_r, False)

    def probe_zombie(self):
        with open(f"/proc/{self.zombie}/stat") as f:
            check(f.read().rsplit(")", 1)[1].split()[0] == "Z", "a zombie")
        if self.first.get("zombie"):
            return "reaped already"
        self.first["zombie"] = True
        pid, status = os.waitpid(self.zombie, 0)
        check(pid == self.zombie and os.WEXITSTATUS(status) == 7, f"exit status {status}")
        return "still a zombie; reaped with its exit status 7"

    def probe_file_locks(self):
        with open("/tmp/flock", "w") as other:  # another open file description: flock excludes it
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                check(exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK), f"flock refused with {exc}")
            else:
                raise AssertionError("the flock was lost: a second locker got it")
        child = os.fork()  # POSIX locks exclude other processes only
        if child == 0:
            with open("/tmp/posixlock", "w") as other:
                try:
                    fcntl.lockf(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os._exit(0)
                os._exit(1)
        _, status = os.waitpid(child, 0)
        check(os.WEXITSTATUS(status) == 0, "the POSIX lock was lost: another process got it")
        return "flock and POSIX lock still held: second lockers are refused"

    def serve(self):
        control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        control.bind(CONTROL)
        control.listen(4)
        while True:
            conn, _ = control.accept()
            with conn:
                name = conn.recv(128).decode().strip()
                try:
                    reply = "ok " + getattr(self, f"probe_{name}")()
                except Exception as exc:
                    reply = f"fail {type(exc).__name__}: {exc}"
                conn.sendall(reply.encode())


if __name__ == "__main__":
    Agent().serve()
