"""What a sandbox may use and do: `SandboxLimits`, how the engine applies them, and what it cannot.

The engine enforces pids, memory (no swap), CPU, capabilities, no-new-privileges and its default
seccomp profile; the limits travel with the sandbox's configuration (and a container label), so a
restore recreates them exactly.  The disk and checkpoint caps, which the engine cannot enforce
here, are held by `_limit_guard`.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ._errors import InvalidConfigError

MIB = 1024 * 1024
# What sandboxed workloads (pip, git, test suites as root in the container) need; Docker's default
# set adds NET_RAW (raw sockets), MKNOD, SYS_CHROOT, SETPCAP, SETFCAP, AUDIT_WRITE, NET_BIND_SERVICE.
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")
DOCKER_DEFAULT_CAPABILITIES = (
    *DEFAULT_CAPABILITIES,
    *("AUDIT_WRITE", "MKNOD", "NET_BIND_SERVICE", "NET_RAW", "SETFCAP", "SETPCAP", "SYS_CHROOT"),
)
LIMITS_LABEL = "belayer.limits"
NO_NEW_PRIVILEGES = "no-new-privileges"
CAP_SYS_RESOURCE = 24


def _caps(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    return tuple(sorted({c.strip().upper().removeprefix("CAP_") for c in value if c.strip()}))


def _at_least(minimum: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_self: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value < minimum:
            raise InvalidConfigError(
                f"sandbox limit {attribute.name} must be >= {minimum} (0 means no limit), got {value}"
            )

    return check


@attrs.frozen
class SandboxLimits:
    """What one sandbox may use; safe defaults, 0 meaning "no limit" for the sizes and counts.

    ``checkpoint_mb`` defaults to memory + disk + 256 MB: a checkpoint holds the layer (at most
    ``disk_mb``) and the process images (at most the memory in use).
    """

    pids: int = attrs.field(default=512, validator=_at_least(0))
    memory_mb: int = attrs.field(default=2048, validator=_at_least(0))
    cpus: float = attrs.field(default=1.0, converter=float, validator=_at_least(0))
    disk_mb: int = attrs.field(default=2048, validator=_at_least(0))
    checkpoint_mb: int | None = attrs.field(default=None)
    capabilities: tuple[str, ...] = attrs.field(default=DEFAULT_CAPABILITIES, converter=_caps)
    no_new_privileges: bool = True
    disk_poll_s: float = attrs.field(default=0.2, validator=_at_least(0.01))

    @checkpoint_mb.validator
    def _check_checkpoint_mb(self, _attr: object, value: int | None) -> None:
        if value is not None and value < 0:
            raise InvalidConfigError(f"sandbox limit checkpoint_mb must be >= 0, got {value}")

    @capabilities.validator
    def _check_caps(self, _attr: object, value: tuple[str, ...]) -> None:
        unknown = [c for c in value if not c.replace("_", "").isalnum()]
        if unknown or "SYS_ADMIN" in value or "ALL" in value:
            raise InvalidConfigError(
                f"capabilities {list(value)}: give capability names such as CHOWN; SYS_ADMIN and ALL "
                "would let an action mount file systems or escape the sandbox"
            )

    @classmethod
    def unlimited(cls) -> SandboxLimits:
        """No resource limit and Docker's default capabilities (what a plain container gets)."""
        return cls(0, 0, 0, 0, 0, DOCKER_DEFAULT_CAPABILITIES, False)

    @property
    def checkpoint_cap_mb(self) -> int:
        """The size cap of one checkpoint in MB (0: none)."""
        if self.checkpoint_mb is not None:
            return self.checkpoint_mb
        if self.memory_mb == 0 or self.disk_mb == 0:
            return 0
        return self.memory_mb + self.disk_mb + 256

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return attrs.asdict(self) | {"capabilities": list(self.capabilities)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxLimits:
        """Rebuild limits from `to_dict` output; unknown keys are an error."""
        unknown = set(data) - {f.name for f in attrs.fields(cls)}
        if unknown:
            raise InvalidConfigError(f"sandbox limits have unknown keys {sorted(unknown)}")
        return cls(**data)

    def label(self) -> str:
        """The JSON stored in the container's ``belayer.limits`` label (read back by `limits_of`)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def create_kwargs(self) -> dict[str, Any]:
        """Arguments of the Docker SDK's ``containers.create`` that apply these limits."""
        kwargs: dict[str, Any] = {
            "cap_drop": ["ALL"],
            "cap_add": list(self.capabilities),
            "security_opt": [f"{NO_NEW_PRIVILEGES}:true"] if self.no_new_privileges else [],
        }
        if self.pids:
            kwargs["pids_limit"] = self.pids
        if self.memory_mb:
            # memory + swap equal to memory: no swap at all.
            kwargs["mem_limit"] = kwargs["memswap_limit"] = self.memory_mb * MIB
        if self.cpus:
            kwargs["nano_cpus"] = round(self.cpus * 1e9)
        return kwargs

    def engine_view(self) -> dict[str, Any]:
        """The part the engine enforces, as `enforced_limits` reads it back from `docker inspect`."""
        return {
            "pids": self.pids,
            "memory_mb": self.memory_mb,
            "swap": False if self.memory_mb else None,
            "cpus": self.cpus,
            "capabilities": list(self.capabilities),
            "no_new_privileges": self.no_new_privileges,
            "seccomp": "default",
        }


def enforced_limits(inspect: Mapping[str, Any]) -> dict[str, Any]:
    """What the engine applies to a container, from its `docker inspect` (compare with `engine_view`)."""
    host = inspect.get("HostConfig") or {}
    memory, memswap = int(host.get("Memory") or 0), int(host.get("MemorySwap") or 0)
    drop = set(_caps(host.get("CapDrop") or ()))
    base = set() if "ALL" in drop else set(DOCKER_DEFAULT_CAPABILITIES) - drop
    security = [str(s) for s in host.get("SecurityOpt") or ()]
    unconfined = any(s.replace("=", ":") == "seccomp:unconfined" for s in security)
    return {
        "pids": max(int(host.get("PidsLimit") or 0), 0),
        "memory_mb": memory // MIB,
        "swap": (memswap != memory) if memory else None,
        "cpus": int(host.get("NanoCpus") or 0) / 1e9,
        "capabilities": sorted(base | set(_caps(host.get("CapAdd") or ()))),
        "no_new_privileges": any(s.split(":")[0].split("=")[0] == NO_NEW_PRIVILEGES for s in security)
        and not any(s.endswith(("=false", ":false")) for s in security if NO_NEW_PRIVILEGES in s),
        "seccomp": "unconfined" if unconfined else ("default" if not host.get("Privileged") else "none"),
    }


def limits_of(inspect: Mapping[str, Any]) -> SandboxLimits:
    """The limits of an existing container: its label (written by `Sandbox.create`) or the engine's view."""
    labels = (inspect.get("Config") or {}).get("Labels") or {}
    if LIMITS_LABEL in labels:
        return SandboxLimits.from_dict(json.loads(labels[LIMITS_LABEL]))
    seen = enforced_limits(inspect)
    return SandboxLimits(
        pids=seen["pids"],
        memory_mb=seen["memory_mb"],
        cpus=seen["cpus"],
        disk_mb=0,
        checkpoint_mb=0,
        capabilities=seen["capabilities"],
        no_new_privileges=seen["no_new_privileges"],
    )


class LimitCause(enum.Enum):
    """Which limit stopped an action."""

    MEMORY = "memory"
    PIDS = "pids"
    DISK = "disk"


# -- what the host allows -------------------------------------------------------------------


def host_has_cap_sys_resource() -> bool:
    """Whether this process (the checkpointing side, like CRIU) holds CAP_SYS_RESOURCE."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def is_root_user(user: str) -> bool:
    """Whether a container ``user`` setting ("", "root", "0", "0:0", "root:grp") runs as uid 0."""
    name = user.split(":", 1)[0]
    return name in ("", "root", "0")


def engine_warnings(info: Mapping[str, Any], limits: SandboxLimits) -> list[str]:
    """What of ``limits`` the engine (its `docker info`) or this host cannot apply, one line each."""
    warnings = []
    needs = (
        (
            "MemoryLimit",
            limits.memory_mb,
            "memory limit: the engine has no memory cgroup; sandboxes run without one",
        ),
        (
            "SwapLimit",
            limits.memory_mb,
            "no-swap: the kernel has no swap accounting, so memory+swap cannot be capped",
        ),
        ("PidsLimit", limits.pids, "pids limit: the engine has no pids cgroup; a fork bomb is not contained"),
        ("CpuCfsQuota", limits.cpus, "CPU quota: the engine has no CFS quota; sandboxes can use every core"),
    )
    for key, wanted, what in needs:
        if wanted and not info.get(key, False):
            warnings.append(f"{what} (enable the cgroup controller in the kernel command line)")
    security = " ".join(str(s) for s in info.get("SecurityOptions") or ())
    if "seccomp" not in security:
        warnings.append("seccomp: the engine runs without seccomp; build Docker with seccomp support")
    if limits.disk_mb:
        warnings.append(
            f"disk cap ({limits.disk_mb} MB): {info.get('Driver', '?')} has no per-container quota here, so "
            f"the cap is enforced by measuring the writable layer every {limits.disk_poll_s} s (longer for "
            "large layers) during an action, at its end and before each checkpoint; an action can "
            "overshoot by what it writes in one interval"
        )
    if not host_has_cap_sys_resource():
        warnings.append(
            "unprivileged user: root here lacks CAP_SYS_RESOURCE, so CRIU cannot dump a process of "
            "another uid (it reads every process's rlimits); checkpointed sandboxes run as root inside "
            f"the container, with only {len(limits.capabilities)} capabilities and no-new-privileges"
        )
    return warnings
