"""The one place Docker SDK errors become belayer-envckpt errors (as httpcore's map_exceptions).

Every call into the Docker SDK runs inside `engine_errors`, so nothing above the engine layer
(and no other package) imports, catches or raises a Docker error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import docker.errors

from ._errors import (
    BelayerEnvckptError,
    ContainerEngineError,
    ContainerNotFoundError,
    ImageNotFoundError,
)

SETUP_HINT = "Run `bash scripts/setup-system` as root (installs and starts Docker and CRIU)."


@contextlib.contextmanager
def engine_errors(what: str, *, container: str = "", image: str = "") -> Iterator[None]:
    """Translate errors of the Docker SDK raised inside the block; ``what`` names the call.

    ``container`` / ``image`` name what the call is about, so a 404 becomes
    `ContainerNotFoundError` or `ImageNotFoundError`.  The SDK's transport errors (requests'
    connection errors derive from OSError) become `ContainerEngineError` too, so keep the block
    to engine calls: a local file error inside it would be reported as an engine error.
    """
    try:
        yield
    except BelayerEnvckptError:
        raise
    except docker.errors.ImageNotFound as exc:
        raise ImageNotFoundError(
            f"{what}: image {image or '?'!r} is not present. Build it locally (bash scripts/setup-system "
            "builds belayer/busybox and belayer/debian-python); there is no registry to pull from"
        ) from exc
    except docker.errors.NotFound as exc:
        if image and not container:
            raise ImageNotFoundError(f"{what}: image {image!r} is not present locally") from exc
        raise ContainerNotFoundError(
            f"{what}: no container {container or '?'!r}. Check the id with `docker ps -a`; a container "
            "that was removed can only come back through `full_restore` of one of its checkpoints"
        ) from exc
    except docker.errors.DockerException as exc:
        raise ContainerEngineError(f"{what} failed: {exc}") from exc
    except OSError as exc:  # requests' ConnectionError and friends: the engine went away
        raise ContainerEngineError(f"{what}: the Docker engine is unreachable ({exc}). {SETUP_HINT}") from exc
