"""One error hierarchy for belayer-envckpt; every message says what to do next."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._exec import ExecResult
    from ._limits import LimitCause


class BelayerEnvckptError(Exception):
    """Root of every error this package raises on purpose."""


class CommandError(BelayerEnvckptError):
    """An external command failed; carries its argv, exit code and stderr.

    ``log_path``: the log the command left (CRIU's dump.log for a failed dump), when there is one.
    """

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, hint: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.log_path: Path | None = None
        message = f"command {self.argv!r} exited with {returncode}: {stderr.strip()[-2000:]}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)


class InvalidConfigError(BelayerEnvckptError, ValueError):
    """A configuration value is out of range or unknown (a sandbox config, a probability, a prefix)."""


class ContainerEngineError(BelayerEnvckptError):
    """The container engine (Docker) is unreachable or refused a call.

    Every error of the Docker SDK is translated into this one (or a subclass) at the engine
    boundary, so no caller of belayer-envckpt ever sees, imports or catches a Docker error.
    """


class ExecStreamError(ContainerEngineError):
    """The engine's answer to an exec start broke the stream format (a bad frame or head, a frame
    cut short): the command's output cannot be trusted, so none is returned."""


class ImageNotFoundError(ContainerEngineError):
    """The image is not present locally (there is no registry to pull from)."""


class ExperimentalDisabledError(ContainerEngineError):
    """The engine runs without experimental features, so it has no checkpoint API."""


class CriuUnavailableError(BelayerEnvckptError):
    """CRIU is missing or fails `criu check` on this kernel."""


class ContainerNotFoundError(BelayerEnvckptError):
    """No container with the given id or name exists."""


class OutsideGuaranteeError(BelayerEnvckptError):
    """The container has network access or host mounts, so its state cannot be captured whole."""


class InvalidIdError(BelayerEnvckptError, ValueError):
    """A trajectory or checkpoint id contains characters that are unsafe in paths and engine names."""


class CheckpointNotFoundError(BelayerEnvckptError):
    """No ready checkpoint matches the request."""


class CheckpointCorruptError(BelayerEnvckptError):
    """A checkpoint is partial or damaged: missing manifest or file, wrong size or checksum."""


class UnknownManifestFormatError(CheckpointCorruptError):
    """A checkpoint's manifest has a format (or keys) this version cannot read, most likely written by a
    newer belayer-envckpt; `CheckpointStore.gc` never removes such a checkpoint."""


class CheckpointDurabilityError(BelayerEnvckptError):
    """A checkpoint was published (renamed into place, readers see it) but making that durable failed.

    ``checkpoint`` is the published `Checkpoint`: it is the latest ready one now, but may not survive
    a host crash or power loss.
    """

    def __init__(self, message: str, checkpoint: object) -> None:
        self.checkpoint = checkpoint
        super().__init__(message)


class SandboxStillPausedError(BelayerEnvckptError):
    """`full_checkpoint` published its checkpoint (``checkpoint``) but could not thaw the sandbox."""

    def __init__(self, message: str, checkpoint: object) -> None:
        self.checkpoint = checkpoint
        super().__init__(message)


class UnsafeArchiveError(CheckpointCorruptError):
    """A layer archive holds a member that would escape the container's root."""


class CheckpointFailedError(BelayerEnvckptError):
    """`full_checkpoint` failed; the partial checkpoint was removed and the previous ready one stays.

    ``log_path`` is CRIU's log of the failed dump, kept in the store's ``failed/`` area, when
    CRIU ran and failed; None otherwise.
    """

    def __init__(self, message: str, log_path: Path | None = None) -> None:
        self.log_path = log_path
        super().__init__(message)


class UnrestorableConnectionError(CheckpointFailedError):
    """CRIU refused to dump a connection it could not restore (named in the message); nothing was published."""


class UncapturedProcessError(CheckpointFailedError):
    """A process of the sandbox is outside its init's tree (named in the message and in
    ``processes``): CRIU would not dump it, so the checkpoint was refused and nothing published."""

    def __init__(self, message: str, processes: tuple[str, ...]) -> None:
        self.processes = processes
        super().__init__(message)


class RuntimeUnreadableError(CheckpointFailedError):
    """The sandbox's processes could not be read whole from /proc (a read was refused, or processes
    kept exiting while they were listed), so a process outside its init's tree cannot be ruled out:
    the checkpoint was refused and nothing published."""


class CheckpointTooLargeError(CheckpointFailedError):
    """The checkpoint would exceed the sandbox's checkpoint size cap; nothing was published."""


class SandboxLimitError(BelayerEnvckptError):
    """A sandbox hit one of its own limits (memory, pids, disk): a detected sandbox failure.

    ``cause`` is a `LimitCause`; ``result`` the interrupted action's `ExecResult` when there was
    one.  Recover like any other sandbox failure: `full_restore` of the latest ready checkpoint.
    """

    def __init__(self, message: str, *, cause: LimitCause, sandbox_id: str, result: object = None) -> None:
        self.cause = cause
        self.sandbox_id = sandbox_id
        self.result = result
        super().__init__(message)


class RestoreFailedError(BelayerEnvckptError):
    """`full_restore` failed after verification; the new container was removed."""


class ProbeFailedError(BelayerEnvckptError):
    """`probe_then_checkpoint`'s read-only probe never gave an accepted answer (``attempts`` tries);
    nothing was checkpointed. ``result`` is the last answer."""

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message)
        self.result = result


class InjectedCrash(BaseException):
    """A fault injected at a named crash point: simulates the checkpointing process dying there.

    It derives from BaseException so that ordinary cleanup (which a dead process could not run)
    is skipped: the partial checkpoint stays on disk for `CheckpointStore.gc` to find.
    """
