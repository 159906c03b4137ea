"""Docker engine access: the SDK where it has the call, its low-level client for checkpoints."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import attrs
import docker
import docker.errors
from docker.models.containers import Container

from ._errors import (
    ContainerNotFoundError,
    CriuUnavailableError,
    EngineError,
    ExperimentalDisabledError,
)
from ._run import run_command

SETUP_HINT = "Run `bash scripts/setup-system` as root (installs and starts Docker and CRIU)."
LABEL = "belayer.envckpt"
# Where dockerd's runc keeps container state (runc --root); see `Engine.checkpoint`.
RUNC_ROOT = Path("/run/docker/runtime-runc/moby")


@attrs.define
class Engine:
    """A connection to the Docker engine with the checkpoint calls the SDK lacks."""

    client: docker.DockerClient
    dump_method: str = attrs.field(default="runc", validator=attrs.validators.in_(("runc", "engine")))
    _checkpoint_ready: bool = attrs.field(default=False, init=False)

    @classmethod
    def connect(cls, dump_method: str = "runc") -> Engine:
        """Connect to the engine named by DOCKER_HOST (default: the local socket).

        ``dump_method``: ``runc`` (direct, faster) or ``engine`` (the engine's checkpoint API).
        """
        try:
            client = docker.from_env(timeout=120)
            client.ping()
        except docker.errors.DockerException as exc:
            raise EngineError(f"cannot reach the Docker engine ({exc}). {SETUP_HINT}") from exc
        return cls(client, dump_method)

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()

    # -- facts about the engine -------------------------------------------------------------

    def experimental(self) -> bool:
        """Whether the engine runs with experimental features (needed for checkpoints)."""
        return bool(self.client.version().get("Experimental", False))

    def require_checkpoint_support(self) -> None:
        """Raise unless the engine has its checkpoint API and CRIU passes its check (cached)."""
        if self._checkpoint_ready:
            return
        if not self.experimental():
            raise ExperimentalDisabledError(
                "the Docker engine runs without experimental features, so it cannot checkpoint. "
                'Put {"experimental": true} in /etc/docker/daemon.json and restart dockerd '
                f"({SETUP_HINT})"
            )
        check_criu()
        self._checkpoint_ready = True

    def root_dir(self) -> Path:
        """The engine's data root (e.g. /var/lib/docker)."""
        return Path(self.client.info()["DockerRootDir"])

    # -- containers -------------------------------------------------------------------------

    def container(self, ref: str) -> Container:
        """Look a container up by id or name."""
        try:
            return self.client.containers.get(ref)
        except docker.errors.NotFound as exc:
            raise ContainerNotFoundError(
                f"no container {ref!r}: check the id with `docker ps -a`; a container that was "
                "removed can only come back through `full_restore` of one of its checkpoints"
            ) from exc
        except docker.errors.DockerException as exc:
            raise EngineError(f"inspecting container {ref!r} failed: {exc}") from exc

    def upper_dir(self, container: Container) -> Path:
        """The container's writable overlay layer on the host."""
        data = container.attrs.get("GraphDriver", {})
        if data.get("Name") != "overlay2" or "UpperDir" not in data.get("Data", {}):
            raise EngineError(
                f"container {container.short_id} uses storage driver {data.get('Name')!r}; "
                "belayer-envckpt needs overlay2 (set it in /etc/docker/daemon.json)"
            )
        return Path(data["Data"]["UpperDir"])

    def checkpoint(self, container: Container, name: str, directory: Path) -> None:
        """Dump the container's processes with CRIU into ``directory/name``, leaving it running.

        With ``runc`` (the default where the engine keeps runc state under its usual root) the dump
        is taken by calling runc directly on the engine's container.  Through the engine API the
        same dump also travels through containerd's content store (tar, digest, write, unpack):
        measured here at 5-9 s against 1-2 s for a 200 MB process.  The images are the same either
        way and restore through the engine.
        """
        if self.dump_method == "runc" and (RUNC_ROOT / container.id).is_dir():
            work = directory / f".{name}-work"
            try:
                run_command(
                    [
                        "runc",
                        "--root",
                        str(RUNC_ROOT),
                        "checkpoint",
                        "--leave-running",
                        "--image-path",
                        str(directory / name),
                        "--work-path",
                        str(work),
                        container.id,
                    ],
                    timeout=600,
                    hint=f"CRIU's log: {work}/dump.log",
                )
            finally:
                shutil.rmtree(work, ignore_errors=True)
            return
        api = self.client.api
        body = {"CheckpointID": name, "Exit": False, "CheckpointDir": str(directory)}
        self._call(api.post(api._url("/containers/{0}/checkpoints", container.id), json=body), "checkpoint")

    def start_from_checkpoint(self, container: Container, name: str, images: Path) -> None:
        """Start a created container from CRIU images.

        The engine refuses a custom checkpoint directory on start, so the images go into the
        container's own checkpoint folder first, under a name and with content unique to this
        restore: containerd keeps uploaded checkpoints as content and refuses a second upload of
        the same one ("already exists"), e.g. when one checkpoint is restored into two containers.
        """
        restore_id = uuid.uuid4().hex[:8]
        name = f"{name}-r{restore_id}"
        target = self.root_dir() / "containers" / container.id / "checkpoints" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(images, target)
        # containerd names the upload by the digest of the images' contents, and an engine-API
        # dump already left that very content behind: a file unique to this restore (CRIU reads
        # only the images it knows) keeps the digests apart.
        (target / "belayer-restore-id").write_text(restore_id)
        api = self.client.api
        try:
            resp = api.post(api._url("/containers/{0}/start", container.id), params={"checkpoint": name})
            self._call(resp, "start from checkpoint")
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def _call(self, response: Any, what: str) -> None:
        if response.status_code >= 400:
            raise EngineError(f"the engine refused {what} ({response.status_code}): {response.text.strip()}")

    def remove(self, ref: str) -> bool:
        """Remove a container by id, forcefully; False if it did not exist."""
        try:
            self.client.containers.get(ref).remove(force=True)
        except docker.errors.NotFound:
            return False
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                return False
            raise EngineError(f"removing container {ref} failed: {exc}") from exc
        return True


def check_criu() -> str:
    """Run `criu check` (``$BELAYER_CRIU`` or ``criu`` on PATH); raise `CriuUnavailableError` if it fails."""
    override = os.environ.get("BELAYER_CRIU")
    search = os.environ.get("PATH", "") + ":/usr/local/bin:/usr/sbin:/sbin"
    criu = shutil.which(override) if override else shutil.which("criu", path=search)
    if criu is None:
        raise CriuUnavailableError(f"criu is not installed. {SETUP_HINT}")
    result = run_command([criu, "check"], timeout=60, check=False)
    if result.returncode != 0:
        raise CriuUnavailableError(
            f"`criu check` fails on this kernel: {(result.stderr or result.stdout).strip()[-500:]}. "
            f"CRIU 4.x is needed (Debian 12's 3.17 fails on new kernels). {SETUP_HINT}"
        )
    return (result.stdout + result.stderr).strip()
