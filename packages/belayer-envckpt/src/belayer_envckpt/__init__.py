"""belayer-envckpt: prefix-consistent checkpoint/restore of sandbox containers (Docker + CRIU).

A `Sandbox` is one container with no network and no host mounts; `full_checkpoint` captures its
overlay layer and its process tree from one frozen moment and publishes them atomically into a
`CheckpointStore`; `full_restore` brings a fresh container back from the latest ready checkpoint.
"""

from __future__ import annotations

from importlib.metadata import version

from ._checkpoint import full_checkpoint, full_restore
from ._cli import ExitCode
from ._criu import check_criu
from ._engine import ContainerInfo, Engine
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
    RestoreFailedError,
    SandboxLimitError,
    SandboxStillPausedError,
    UnknownManifestFormatError,
    UnrestorableConnectionError,
    UnsafeArchiveError,
)
from ._exec import ExecResult
from ._faults import CheckpointFault, CrashPoint, FaultAction, FaultInjector
from ._limits import LimitCause, SandboxLimits
from ._sandbox import Sandbox, SandboxConfig
from ._store import Checkpoint, CheckpointStore

__version__ = version("belayer-envckpt")

__all__ = [
    "BelayerEnvckptError",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointDurabilityError",
    "CheckpointFailedError",
    "CheckpointFault",
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
    "RestoreFailedError",
    "Sandbox",
    "SandboxConfig",
    "SandboxLimitError",
    "SandboxLimits",
    "SandboxStillPausedError",
    "UnknownManifestFormatError",
    "UnrestorableConnectionError",
    "UnsafeArchiveError",
    "__version__",
    "check_criu",
    "full_checkpoint",
    "full_restore",
]
