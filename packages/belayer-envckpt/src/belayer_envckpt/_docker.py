"""Docker engine access (`Engine`): the SDK where it has the call, its low-level client for checkpoints.

The module is `_docker`, not `_engine`: in Belayer an engine is mostly the LLM engine of belayer-shadow.

This module and `_boundary` are the only ones that call the Docker SDK; every error it raises is
translated there into a belayer-envckpt error.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import docker
from docker.models.containers import Container

from ._boundary import SETUP_HINT, engine_errors
from ._criu import check_criu
from ._errors import (
    CommandError,
    ContainerEngineError,
    ContainerNotFoundError,
    ExperimentalDisabledError,
    ImageNotFoundError,
    InvalidConfigError,
)
from ._exec import ExecResult
from ._host_commands import run_command
from ._limits import SandboxLimits
from ._restore_images import stage_images

LABEL = "belayer.envckpt"
# Where dockerd's runc keeps container state (runc --root); see `Engine.checkpoint`.
RUNC_ROOT = Path("/run/docker/runtime-runc/moby")
DUMP_METHODS = ("runc", "engine")


@attrs.frozen
class ContainerInfo:
    """What `Engine.list_containers` reports about one container."""

    id: str
    name: str
    status: str
    labels: dict[str, str]


@attrs.define
class Engine:
    """A connection to the Docker engine with the checkpoint calls the SDK lacks."""

    _client: docker.DockerClient  # docker-py stays inside this package
    dump_method: str = attrs.field(default="runc")
    # Full restores hand the engine links to the store's page images (`_restore_images`).
    restore_in_place: bool = attrs.field(default=True, kw_only=True)
    _checkpoint_ready: bool = attrs.field(default=False, init=False)

    @dump_method.validator
    def _check_dump_method(self, _attr: object, value: str) -> None:
        if value not in DUMP_METHODS:
            raise InvalidConfigError(f"dump_method must be one of {DUMP_METHODS}, got {value!r}")

    @classmethod
    def connect(cls, dump_method: str = "runc", *, restore_in_place: bool = True) -> Engine:
        """Connect to the engine named by DOCKER_HOST (default: the local socket).

        ``dump_method``: ``runc`` (direct, faster) or ``engine`` (the engine's checkpoint API).
        ``restore_in_place``: CRIU reads a full restore's page images from the store where the
        engine sees it (`start_from_checkpoint`); False copies them through the engine every time.
        """
        if dump_method not in DUMP_METHODS:
            raise InvalidConfigError(f"dump_method must be one of {DUMP_METHODS}, got {dump_method!r}")
        try:
            with engine_errors("connecting to the Docker engine"):
                client = docker.from_env(timeout=120)
                client.ping()
        except ContainerEngineError as exc:
            raise ContainerEngineError(f"cannot reach the Docker engine ({exc}). {SETUP_HINT}") from exc
        return cls(client, dump_method, restore_in_place=restore_in_place)

    def close(self) -> None:
        """Close the connection pool."""
        with engine_errors("closing the engine connection"):
            self._client.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- facts about the engine -------------------------------------------------------------

    def version(self) -> str:
        """The engine's version string."""
        with engine_errors("asking the engine for its version"):
            return str(self._client.version().get("Version", "?"))

    def experimental(self) -> bool:
        """Whether the engine runs with experimental features (needed for checkpoints)."""
        with engine_errors("asking the engine for its version"):
            return bool(self._client.version().get("Experimental", False))

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

    def info(self) -> dict[str, Any]:
        """The engine's `docker info`: storage driver, cgroup controllers, security options."""
        with engine_errors("reading the engine's info"):
            return dict(self._client.info())

    def root_dir(self) -> Path:
        """The engine's data root (e.g. /var/lib/docker)."""
        with engine_errors("asking the engine for its data root"):
            return Path(self._client.info()["DockerRootDir"])

    # -- images -----------------------------------------------------------------------------

    def image_id(self, image: str) -> str:
        """The id of a local image; `ImageNotFoundError` if it is not present."""
        with engine_errors(f"inspecting image {image!r}", image=image):
            return str(self._client.images.get(image).id)

    def has_image(self, image: str) -> bool:
        """Whether ``image`` is present locally."""
        try:
            self.image_id(image)
        except ImageNotFoundError:
            return False
        return True

    def commit_archive(
        self,
        base_image: str,
        archive: bytes,
        *,
        repository: str,
        tag: str,
        labels: Mapping[str, str] | None = None,
    ) -> str:
        """Build ``repository:tag`` from ``base_image`` plus a tar ``archive`` unpacked at ``/``.

        No registry and no build context: a container is created (never started) from the base
        image, the archive is copied in and the container committed, then removed.
        """
        name = f"{repository}:{tag}"
        container: Container | None = None
        try:
            with engine_errors(f"building image {name} from {base_image!r}", image=base_image):
                container = self._client.containers.create(
                    base_image, network_mode="none", labels={**(labels or {}), LABEL: "1"}
                )
                if not container.put_archive("/", archive):
                    raise ContainerEngineError(f"copying files into a container of {base_image!r} failed")
                container.commit(repository=repository, tag=tag)
        finally:
            if container is not None:
                self.remove(str(container.id))
        return name

    def run(
        self,
        image: str,
        command: Sequence[str],
        *,
        timeout_s: float = 120.0,
        labels: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> ExecResult:
        """Run ``command`` in a throwaway container of ``image`` (no network) and remove it.

        A command still running at ``timeout_s`` is killed and reported with ``timed_out``.  The
        container gets the engine-enforced part of ``limits`` (default `SandboxLimits()`: pids,
        memory without swap, CPU, capabilities, no-new-privileges); the disk cap needs a `Sandbox`.
        """
        create_limits = (limits or SandboxLimits()).create_kwargs()
        started = time.perf_counter()
        container: Container | None = None
        what = f"running {list(command)[:3]!r} in a container of {image!r}"
        try:
            with engine_errors(what, image=image):
                container = self._client.containers.create(
                    image,
                    list(command),
                    network_mode="none",
                    labels={**(labels or {}), LABEL: "1"},
                    **create_limits,
                )
                container.start()
                timed_out = False
                try:
                    code = int(container.wait(timeout=timeout_s)["StatusCode"])
                except OSError:  # requests' read timeout: the command outlived timeout_s
                    timed_out, code = True, -1
                    container.kill()
                stdout = container.logs(stdout=True, stderr=False).decode(errors="replace")
                stderr = container.logs(stdout=False, stderr=True).decode(errors="replace")
        finally:
            if container is not None:
                self.remove(str(container.id))
        return ExecResult(stdout, stderr, code, time.perf_counter() - started, timed_out)

    # -- containers -------------------------------------------------------------------------

    def container(self, ref: str) -> Container:
        """Look a container up by id or name (the SDK's object, for this package only)."""
        with engine_errors(f"inspecting container {ref!r}", container=ref):
            return self._client.containers.get(ref)

    def list_containers(self, labels: Sequence[str] = ()) -> list[ContainerInfo]:
        """Every container (running or not) carrying all ``labels`` (``key`` or ``key=value``)."""
        with engine_errors("listing containers"):
            found = self._client.containers.list(
                all=True, filters={"label": list(labels)} if labels else None
            )
            return [ContainerInfo(str(c.id), str(c.name), str(c.status), dict(c.labels)) for c in found]

    def upper_dir(self, container: Container) -> Path:
        """The container's writable overlay layer on the host."""
        data = container.attrs.get("GraphDriver", {})
        if data.get("Name") != "overlay2" or "UpperDir" not in data.get("Data", {}):
            raise ContainerEngineError(
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
                    timeout_s=600,
                )
            except CommandError as exc:
                # CRIU's log stays in the (partial) checkpoint directory for the caller to keep.
                log = work / "dump.log"
                exc.log_path = log if log.is_file() else None
                raise
            shutil.rmtree(work, ignore_errors=True)
            return
        api = self._client.api
        body = {"CheckpointID": name, "Exit": False, "CheckpointDir": str(directory)}
        with engine_errors("checkpoint through the engine", container=str(container.id)):
            response = api.post(api._url("/containers/{0}/checkpoints", container.id), json=body)
        self._call(response, "checkpoint")

    def start_from_checkpoint(self, container: Container, name: str, images: Path) -> str:
        """Start a created container from CRIU images; how the page images went in: `IN_PLACE`
        (links to the store's files, read by CRIU where they lie) or `COPIED`.

        The engine refuses a custom checkpoint directory on start, so the images go into the
        container's own checkpoint folder first, under a name and with content unique to this
        restore: containerd keeps uploaded checkpoints as content and refuses a second upload of
        the same one ("already exists"), e.g. when one checkpoint is restored into two containers.
        The engine streams that folder through containerd's content store: with the page images
        as links (`_restore_images.stage_images`) only the small images travel.
        """
        restore_id = uuid.uuid4().hex[:8]
        name = f"{name}-r{restore_id}"
        target = self.root_dir() / "containers" / container.id / "checkpoints" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = stage_images(images, target, in_place=self.restore_in_place)
        # containerd names the upload by the digest of the images' contents, and an engine-API
        # dump already left that very content behind: a file unique to this restore (CRIU reads
        # only the images it knows) keeps the digests apart.
        (target / "belayer-restore-id").write_text(restore_id)
        api = self._client.api
        try:
            with engine_errors("start from checkpoint", container=str(container.id)):
                resp = api.post(api._url("/containers/{0}/start", container.id), params={"checkpoint": name})
            self._call(resp, "start from checkpoint")
        finally:
            shutil.rmtree(target, ignore_errors=True)
            self._remove_restore_copies(restore_id)
        return staged

    def _remove_restore_copies(self, restore_id: str) -> None:
        """Remove the copy of the images the engine made for this restore.

        containerd copies the checkpoint into a ``ctrd-checkpoint*`` temp folder to restore from
        and leaves it there: one copy of the images per restore (tens of MB for a Python sandbox),
        which fills a long run's disk.  Ours are the ones holding this restore's id; the restore has
        finished (or failed) by now, so nothing reads them any more.
        """
        roots = {Path("/tmp"), Path(tempfile.gettempdir())}
        for root in roots:
            for folder in root.glob("ctrd-checkpoint*"):
                try:
                    if (folder / "belayer-restore-id").read_text() == restore_id:
                        shutil.rmtree(folder, ignore_errors=True)
                except OSError:
                    continue

    def _call(self, response: Any, what: str) -> None:
        if response.status_code >= 400:
            raise ContainerEngineError(
                f"the engine refused {what} ({response.status_code}): {response.text.strip()}"
            )

    def remove(self, ref: str, timeout_s: float = 60.0) -> bool:
        """Remove a container by id, forcefully; False if it did not exist.

        A removal already in progress (another caller's, or the engine's for a container whose
        owner died mid-removal: the engine answers 409) is waited for, up to ``timeout_s``: when
        this returns True the container is gone.
        """
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                with engine_errors(f"removing container {ref}", container=ref):
                    try:
                        self._client.containers.get(ref).remove(force=True)
                    except docker.errors.APIError as exc:
                        if not _removal_in_progress(exc) or time.monotonic() > deadline:
                            raise
                        waited = True
                        time.sleep(0.1)
                        continue
            except ContainerNotFoundError:
                return waited  # gone: it existed if another removal was under way
            return True


def _removal_in_progress(exc: docker.errors.APIError) -> bool:
    """The engine's 409 for a container that another removal is already taking away."""
    return exc.status_code == 409 and "already in progress" in str(exc.explanation or exc)
