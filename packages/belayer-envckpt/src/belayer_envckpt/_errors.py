"""One error hierarchy for belayer-envckpt; every message says what to do next."""

from __future__ import annotations

from collections.abc import Sequence


class BelayerEnvckptError(Exception):
    """Root of every error this package raises on purpose."""


class CommandError(BelayerEnvckptError):
    """An external command failed; carries its argv, exit code and stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, hint: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        message = f"command {self.argv!r} exited with {returncode}: {stderr.strip()[-2000:]}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)


class EngineError(BelayerEnvckptError):
    """The Docker engine is unreachable or refused a call."""


class ExperimentalDisabledError(EngineError):
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


class UnsafeArchiveError(CheckpointCorruptError):
    """A layer archive holds a member that would escape the container's root."""


class CheckpointFailedError(BelayerEnvckptError):
    """`full_checkpoint` failed; the partial checkpoint was removed and the previous ready one stays."""


class RestoreFailedError(BelayerEnvckptError):
    """`full_restore` failed after verification; the new container was removed."""


class ActionTimeoutError(BelayerEnvckptError):
    """Raised only by callers that ask `exec` to treat a timeout as an error."""


class InjectedCrash(BaseException):
    """A fault injected at a named crash point: simulates the checkpointing process dying there.

    It derives from BaseException so that ordinary cleanup (which a dead process could not run)
    is skipped: the partial checkpoint stays on disk for `CheckpointStore.gc` to find.
    """
