"""belayer-envckpt: prefix-consistent checkpoint/restore of sandbox containers (Docker + CRIU).

A `Sandbox` is one container with no network and no host mounts; `full_checkpoint` captures its
overlay layer and its process tree from one frozen moment and publishes them atomically into a
`CheckpointStore`; `checkpoint` takes the cheapest kind that captures the state (`CheckpointKind`);
`full_restore` brings a fresh container back from the latest ready checkpoint of any kind.
"""

from __future__ import annotations

from importlib.metadata import version

from ._checkpoint import full_checkpoint, full_restore
from ._cli import ExitCode
from ._criu import check_criu
from ._docker import ContainerInfo, Engine
from ._errors import (
    BelayerEnvckptError,
    CheckpointCorruptError,
    CheckpointDurabilityError,
    CheckpointFailedError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
    CommandError,
    ContainerEngineError,
    ContainerNotFoundError,
    CriuUnavailableError,
    ExecStreamError,
    ExperimentalDisabledError,
    ImageNotFoundError,
    InjectedCrash,
    InvalidConfigError,
    InvalidIdError,
    OutsideGuaranteeError,
    ProbeFailedError,
    RestoreFailedError,
    RuntimeUnreadableError,
    SandboxLimitError,
    SandboxStillPausedError,
    UncapturedProcessError,
    UnknownManifestFormatError,
    UnrestorableConnectionError,
    UnsafeArchiveError,
)
from ._exec import ExecResult
from ._faults import CheckpointFault, CrashPoint, FaultAction, FaultInjector
from ._kinds import checkpoint, next_checkpoint_kind
from ._limits import LimitCause, SandboxLimits
from ._probe_checkpoint import probe_then_checkpoint
from ._sandbox import Sandbox, SandboxConfig
from ._sandbox_like import SandboxLike
from ._spares import SparePool
from ._store import Checkpoint, CheckpointKind, CheckpointStore

__version__ = version("belayer-envckpt")

__all__ = [
    "BelayerEnvckptError",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointDurabilityError",
    "CheckpointFailedError",
    "CheckpointFault",
    "CheckpointKind",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CheckpointTooLargeError",
    "CommandError",
    "ContainerEngineError",
    "ContainerInfo",
    "ContainerNotFoundError",
    "CrashPoint",
    "CriuUnavailableError",
    "Engine",
    "ExecResult",
    "ExecStreamError",
    "ExitCode",
    "ExperimentalDisabledError",
    "FaultAction",
    "FaultInjector",
    "ImageNotFoundError",
    "InjectedCrash",
    "InvalidConfigError",
    "InvalidIdError",
    "LimitCause",
    "OutsideGuaranteeError",
    "ProbeFailedError",
    "RestoreFailedError",
    "RuntimeUnreadableError",
    "Sandbox",
    "SandboxConfig",
    "SandboxLike",
    "SandboxLimitError",
    "SandboxLimits",
    "SandboxStillPausedError",
    "SparePool",
    "UncapturedProcessError",
    "UnknownManifestFormatError",
    "UnrestorableConnectionError",
    "UnsafeArchiveError",
    "__version__",
    "check_criu",
    "checkpoint",
    "full_checkpoint",
    "full_restore",
    "next_checkpoint_kind",
    "probe_then_checkpoint",
]
