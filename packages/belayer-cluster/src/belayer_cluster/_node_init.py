"""PID 1 of an isolated node (`IsolatedRayCluster`): its mounts, then its command, then reaping.

Run as `python -m belayer_cluster._node_init --shared DIR --ro PATH ... --hostname NAME -- CMD ...`
inside fresh network, PID, IPC, UTS and mount namespaces (`nsenter --net` + `unshare`). It

- mounts a private tmpfs on /tmp and on /dev/shm (nothing of the host's, nothing of another node's);
- binds the one shared folder back in at its own path (checkpoints, the router journal, run folders)
  and the project's Python environment read-only (every path given with `--ro`);
- mounts the node's own /proc (its PID namespace) and, with `--host-proc PATH`, the host's /proc
  read-only at PATH: the one view of the host a node has, for the processes of the Docker
  containers it owns (the daemon is the host's; belayer-envckpt reads them there,
  `BELAYER_ENVCKPT_HOST_PROC`);
- names the node (`hostname`), starts `CMD` (the node's `ray start --block`) and reaps every
  orphan of the namespace until `CMD` exits; then it ends every process left in the namespace
  and exits with `CMD`'s code. A SIGTERM is passed on to `CMD` (a graceful stop); a SIGKILL of
  this process from the host ends every process of the node at once (the kernel's rule for a
  PID namespace's init), which is how a machine is lost whole.

The paths are opened before the tmpfs mounts hide them, so a shared folder or an environment under
/tmp is bound in too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    result = _libc.mount(
        None if source is None else source.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        None if data is None else data.encode(),
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source!r} on {target!r}: {os.strerror(errno)}")


def _bind(fd: int, target: str, read_only: bool, recursive: bool = True) -> None:
    os.makedirs(target, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND | (_MS_REC if recursive else 0))
    if read_only:
        _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args:
        print(
            "usage: _node_init [--shared DIR] [--ro PATH ...] [--hostname NAME] -- CMD ...", file=sys.stderr
        )
        return 2
    cut = args.index("--")
    parser = argparse.ArgumentParser(prog="belayer_cluster._node_init")
    parser.add_argument("--shared", action="append", default=[])
    parser.add_argument("--ro", action="append", default=[])
    parser.add_argument("--hostname", default="")
    parser.add_argument("--host-proc", default="", help="where to bind the host's /proc read-only")
    options = parser.parse_args(args[:cut])
    command = args[cut + 1 :]
    if os.getpid() != 1:
        print("_node_init must run as PID 1 of a new PID namespace (unshare --pid --fork)", file=sys.stderr)
        return 2
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing of this node's mounts reaches the host
    opened = [(os.open(p, os.O_PATH | os.O_DIRECTORY), p, False) for p in options.shared]
    opened += [(os.open(p, os.O_PATH | os.O_DIRECTORY), p, True) for p in options.ro if os.path.isdir(p)]
    host_proc = os.open("/proc", os.O_PATH | os.O_DIRECTORY)  # the host's, before this node's own
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)  # the node's PID namespace
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    for fd, path, read_only in sorted(opened, key=lambda item: item[1]):
        _bind(fd, path, read_only)
        os.close(fd)
    if options.host_proc:
        # Not recursive: the node's own procfs, mounted on the host's /proc just above, is a submount
        # of it and a recursive bind would carry it along, hiding the host's processes.
        _bind(host_proc, options.host_proc, read_only=True, recursive=False)
    os.close(host_proc)
    if options.hostname:
        socket.sethostname(options.hostname)
    os.chdir("/")
    child = subprocess.Popen(command)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: child.send_signal(s))
    code = 1
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            break
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)  # every process left in the namespace (never this one, its init)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
