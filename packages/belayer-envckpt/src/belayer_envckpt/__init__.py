"""belayer-envckpt: prefix-consistent checkpoint/restore of sandbox containers (Docker + CRIU).

A `Sandbox` is one container with no network and no host mounts; `full_checkpoint` captures its
overlay layer and its process tree from one frozen moment and publishes them atomically into a
`CheckpointStore`; `full_restore` brings a fresh container back from the latest ready checkpoint.
"""

from __future__ import annotations

from ._checkpoint import full_checkpoint, full_restore
from ._engine import Engine, check_criu
from ._errors import (
    BelayerEnvckptError,
    CheckpointCorruptError,
    CheckpointFailedError,
    CheckpointNotFoundError,
    CommandError,
    ContainerNotFoundError,
    CriuUnavailableError,
    EngineError,
    ExperimentalDisabledError,
    InjectedCrash,
    InvalidIdError,
    OutsideGuaranteeError,
    RestoreFailedError,
    UnsafeArchiveError,
)
from ._faults import CheckpointFault, CrashPoint, FaultAction, FaultInjector
from ._sandbox import ExecResult, Sandbox, SandboxConfig
from ._store import Checkpoint, CheckpointStore

__version__ = "0.1.0"

__all__ = [
    "BelayerEnvckptError",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointFailedError",
    "CheckpointFault",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CommandError",
    "ContainerNotFoundError",
    "CrashPoint",
    "CriuUnavailableError",
    "Engine",
    "EngineError",
    "ExecResult",
    "ExperimentalDisabledError",
    "FaultAction",
    "FaultInjector",
    "InjectedCrash",
    "InvalidIdError",
    "OutsideGuaranteeError",
    "RestoreFailedError",
    "Sandbox",
    "SandboxConfig",
    "UnsafeArchiveError",
    "__version__",
    "check_criu",
    "full_checkpoint",
    "full_restore",
]
