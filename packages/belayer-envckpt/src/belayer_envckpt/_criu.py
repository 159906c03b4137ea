"""Facts about the installed CRIU: its version against the kernel, runc's options, its logs."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from ._boundary import SETUP_HINT
from ._errors import CriuUnavailableError
from ._host_commands import run_command
from ._procfs import host_proc

# runc hands this file to CRIU on every dump and restore (Docker passes no CRIU options itself).
RUNC_CONF = Path("/etc/criu/runc.conf")
# Kernels from 6.16 refuse SO_PASSCRED / SO_PASSSEC on inet sockets, which CRIU before 4.2 asks
# for on every socket it dumps (CRIU issues #2705 / #2718): it cannot dump a TCP socket there.
KERNEL_NEEDS_NEW_CRIU = (6, 16)
CRIU_FOR_NEW_KERNELS = (4, 2)


# What runc must pass to CRIU for the sandboxes' objects to survive (see `doctor_checks`).
RUNC_OPTIONS = ("tcp-established", "file-locks")


def criu_binary() -> str | None:
    """``$BELAYER_CRIU`` or ``criu`` on PATH (also /usr/local/bin, /usr/sbin, /sbin)."""
    override = os.environ.get("BELAYER_CRIU")
    search = os.environ.get("PATH", "") + ":/usr/local/bin:/usr/sbin:/sbin"
    return shutil.which(override) if override else shutil.which("criu", path=search)


def check_criu() -> str:
    """Run `criu check` (``$BELAYER_CRIU`` or ``criu`` on PATH); raise `CriuUnavailableError` if it fails."""
    criu = criu_binary()
    if criu is None:
        raise CriuUnavailableError(f"criu is not installed. {SETUP_HINT}")
    result = run_command([criu, "check"], timeout_s=60, check=False)
    if result.returncode != 0:
        raise CriuUnavailableError(
            f"`criu check` fails on this kernel: {(result.stderr or result.stdout).strip()[-500:]}. "
            f"CRIU 4.2 or newer is needed (Debian 12's 3.17 fails on new kernels). {SETUP_HINT}"
        )
    return (result.stdout + result.stderr).strip()


def criu_version(criu: str) -> str:
    """What ``criu --version`` reports, e.g. ``"4.2.1"`` (empty if it says nothing readable)."""
    result = run_command([criu, "--version"], timeout_s=60, check=False)
    match = re.search(r"Version:\s*(\S+)", result.stdout + result.stderr)
    return match.group(1) if match else ""


def doctor_checks() -> dict[str, dict[str, Any]]:
    """Checks of CRIU's version against the kernel and of runc's CRIU options, for `doctor`."""
    checks: dict[str, dict[str, Any]] = {}
    criu, kernel = criu_binary(), kernel_release()
    if criu is not None:
        version = criu_version(criu)
        problem = kernel_fit(version, kernel)
        checks["criu vs kernel"] = {
            "ok": problem is None,
            "detail": problem or f"CRIU {version} fits kernel {kernel}",
        }
    missing = [option for option in RUNC_OPTIONS if option not in runc_conf_options()]
    checks["runc criu options"] = {
        "ok": not missing,
        "detail": f"{', '.join(RUNC_OPTIONS)} in {RUNC_CONF}"
        if not missing
        else f"{RUNC_CONF} lacks {', '.join(missing)}: sandboxes holding established TCP connections "
        f"or file locks cannot be checkpointed. {SETUP_HINT}",
    }
    return checks


def parse_version(text: str) -> tuple[int, ...]:
    """The leading dotted numbers of a version string: ``"6.18.44-fc"`` -> ``(6, 18, 44)``."""
    match = re.search(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def kernel_fit(criu_version: str, kernel_release: str) -> str | None:
    """None when this CRIU can checkpoint sandboxes on this kernel, else what is wrong and what to do."""
    criu, kernel = parse_version(criu_version), parse_version(kernel_release)
    if not criu:
        return f"cannot read CRIU's version from {criu_version!r}. {SETUP_HINT}"
    if kernel >= KERNEL_NEEDS_NEW_CRIU and criu < CRIU_FOR_NEW_KERNELS:
        need = ".".join(map(str, CRIU_FOR_NEW_KERNELS))
        return (
            f"CRIU {criu_version} cannot dump TCP sockets on kernel {kernel_release} (kernels >= 6.16 "
            f"refuse SO_PASSCRED on inet sockets): every sandbox holding a TCP socket would fail to "
            f"checkpoint. Install CRIU >= {need}: `bash scripts/setup-system` takes it from Debian sid"
        )
    return None


def kernel_release() -> str:
    """The running kernel's release (``uname -r``)."""
    return os.uname().release


def runc_conf_options(path: Path = RUNC_CONF) -> set[str]:
    """The options in runc's CRIU configuration file (empty when there is none)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return set()
    return {line.split("#", 1)[0].strip() for line in lines} - {""}


# Error lines CRIU prints and then carries on from (not why a dump failed).
BENIGN_ERRORS = ("Can't setup RLIMIT_NOFILE",)


def first_error_line(log: Path) -> str:
    """The first line of a CRIU log that reports an error (CRIU marks them ``Error``), benign ones aside."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if re.search(r"\bError\b", line) and not any(benign in line for benign in BENIGN_ERRORS):
            return line.strip()
    return ""


def log_named_in(message: str) -> Path | None:
    """The CRIU log an engine's error message points at (``path= ...criu-dump.log``), if it exists."""
    match = re.search(r"(?:log file|path)[:=]\s*(/\S+?\.log)\b", message)
    if match is None:
        return None
    path = Path(match.group(1))
    return path if path.is_file() else None


def unrestorable_connection(error_line: str) -> int | None:
    """The socket inode of a connection CRIU refused to dump: None if the line is about something
    else, 0 if CRIU did not name the socket.

    CRIU refuses a connection it could not bring back: one still in a listener's accept queue
    ("In-flight connection"), or an established TCP connection without tcp-established.
    """
    match = re.search(r"In-flight connection \(\w\) for ([0-9a-f]+)", error_line)
    if match is not None:
        return int(match.group(1), 16)
    if "Connected TCP socket" in error_line:
        return 0  # CRIU names no socket here
    return None


def describe_inet_socket(pid: int, inode: int) -> str:
    """``proto local -> remote (state)`` of the socket ``inode`` in the network namespace of ``pid``."""
    states = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "0A": "LISTEN"}
    for proto in ("tcp", "tcp6"):
        try:
            lines = Path(f"{host_proc()}/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9] == str(inode):
                local, remote = (_address(f) for f in fields[1:3])
                return f"{proto} {local} -> {remote} ({states.get(fields[3], fields[3])})"
    return f"socket inode {inode}"


def _address(field: str) -> str:
    host, port = field.split(":")
    if len(host) == 8:
        octets = [str(int(host[i : i + 2], 16)) for i in range(6, -1, -2)]
        return f"{'.'.join(octets)}:{int(port, 16)}"
    return f"[{host}]:{int(port, 16)}"
