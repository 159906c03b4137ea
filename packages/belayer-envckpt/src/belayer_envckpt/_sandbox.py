"""Sandbox containers: created inside the guarantee, with actions that count prefix boundaries."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import docker.errors
from docker.models.containers import Container

from ._engine import LABEL, Engine
from ._errors import EngineError, OutsideGuaranteeError
from ._ids import validate_id

TRAJECTORY_LABEL = "belayer.trajectory"
KEEPALIVE = ("/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done")


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _str_dict(value: Mapping[str, str]) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()}


@attrs.frozen
class SandboxConfig:
    """How a sandbox container is created; stored in every checkpoint to recreate it exactly."""

    image: str = attrs.field()
    command: tuple[str, ...] = attrs.field(default=KEEPALIVE, converter=_str_tuple)
    working_dir: str = "/"
    env: dict[str, str] = attrs.field(factory=dict, converter=_str_dict)
    user: str = ""
    hostname: str = "sandbox"
    mem_limit: str = ""
    labels: dict[str, str] = attrs.field(factory=dict, converter=_str_dict)

    @image.validator
    def _check_image(self, _attr: object, value: str) -> None:
        if not value:
            raise ValueError("image: give a local image name such as belayer/busybox")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the command as a list, as it reads back from JSON)."""
        return attrs.asdict(self) | {"command": list(self.command)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxConfig:
        """Rebuild a configuration from `to_dict` output; unknown keys are an error."""
        unknown = set(data) - {f.name for f in attrs.fields(cls)}
        if unknown:
            raise ValueError(f"sandbox config has unknown keys {sorted(unknown)}")
        return cls(**data)


@attrs.frozen
class ExecResult:
    """The outcome of one action."""

    stdout: str
    stderr: str
    exit_code: int
    duration: float
    timed_out: bool = False


def check_guarantee(attrs_: Mapping[str, Any]) -> None:
    """Refuse a container whose state a checkpoint could not capture whole."""
    name = attrs_.get("Name", "").lstrip("/") or attrs_.get("Id", "")[:12]
    host = attrs_.get("HostConfig", {})
    problems = []
    if host.get("NetworkMode", "") != "none":
        problems.append(f"network mode {host.get('NetworkMode')!r} (needs 'none')")
    for mount in attrs_.get("Mounts", []) or []:
        problems.append(f"{mount.get('Type')} mount at {mount.get('Destination')}")
    for tmpfs in host.get("Tmpfs") or {}:
        problems.append(f"tmpfs mount at {tmpfs}")
    if host.get("Privileged"):
        problems.append("privileged mode")
    if problems:
        raise OutsideGuaranteeError(
            f"container {name} is outside the checkpoint guarantee: {', '.join(problems)}. "
            "Create sandboxes with `Sandbox.create` (no network, no host mounts, no volumes); "
            "their whole state then lives in the overlay layer and the process tree."
        )


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (an exec's children keep its output pipe open)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    todo = [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        with contextlib.suppress(ProcessLookupError):
            os.kill(current, signal.SIGKILL)


@attrs.define(eq=False)
class Sandbox:
    """One container inside the guarantee; actions and checkpoints exclude each other.

    ``prefix`` counts committed action boundaries: it is ``k`` in the trajectory's prefix.
    """

    engine: Engine
    container: Container
    config: SandboxConfig
    trajectory: str = ""
    prefix: int = 0
    context_ref: str = ""
    restore_timings_ms: dict[str, float] = attrs.field(factory=dict)
    _boundary: threading.RLock = attrs.field(factory=threading.RLock, repr=False)

    @classmethod
    def create(
        cls, engine: Engine, config: SandboxConfig, *, trajectory: str = "", start: bool = True
    ) -> Sandbox:
        """Create (and by default start) a container with no network and no host mounts."""
        if trajectory:
            validate_id(trajectory, "trajectory")
        labels = {**config.labels, LABEL: "1"}
        if trajectory:
            labels[TRAJECTORY_LABEL] = trajectory
        name = f"belayer-{trajectory or 'sandbox'}-{uuid.uuid4().hex[:8]}"
        try:
            container = engine.client.containers.create(
                config.image,
                list(config.command),
                name=name,
                network_mode="none",
                working_dir=config.working_dir,
                environment=config.env,
                user=config.user or None,
                hostname=config.hostname,
                mem_limit=config.mem_limit or None,
                labels=labels,
            )
        except docker.errors.ImageNotFound as exc:
            raise EngineError(
                f"image {config.image!r} is not present: build it locally (bash scripts/setup-system "
                "builds belayer/busybox and belayer/debian-python); there is no registry to pull from"
            ) from exc
        except docker.errors.DockerException as exc:
            raise EngineError(f"creating a sandbox from {config.image!r} failed: {exc}") from exc
        sandbox = cls(engine, container, config, trajectory)
        if start:
            container.start()
            container.reload()
        return sandbox

    @classmethod
    def attach(cls, engine: Engine, ref: str, *, trajectory: str = "", prefix: int = 0) -> Sandbox:
        """Wrap an existing container, refusing one outside the guarantee."""
        container = engine.container(ref)
        check_guarantee(container.attrs)
        cfg = container.attrs["Config"]
        env = dict(item.split("=", 1) for item in cfg.get("Env") or [] if "=" in item)
        config = SandboxConfig(
            image=cfg["Image"],
            command=tuple(cfg.get("Cmd") or KEEPALIVE),
            working_dir=cfg.get("WorkingDir") or "/",
            env=env,
            user=cfg.get("User") or "",
            hostname=cfg.get("Hostname") or "sandbox",
            labels={k: v for k, v in (cfg.get("Labels") or {}).items() if k not in (LABEL, TRAJECTORY_LABEL)},
        )
        return cls(engine, container, config, trajectory, prefix)

    @property
    def id(self) -> str:
        """The container's full id."""
        return str(self.container.id)

    def status(self) -> str:
        """The engine's view: created, running, paused, exited, dead or removed."""
        try:
            self.container.reload()
        except docker.errors.NotFound:
            return "removed"
        return str(self.container.status)

    def exec(self, command: str | Sequence[str], timeout: float = 60.0) -> ExecResult:
        """Run one action; it completes (or is killed at ``timeout``) before a checkpoint starts."""
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        with self._boundary:
            api = self.engine.client.api
            try:
                exec_id = api.exec_create(self.id, argv, workdir=self.config.working_dir)["Id"]
            except docker.errors.APIError as exc:
                raise EngineError(f"cannot run an action in sandbox {self.id[:12]}: {exc}") from exc
            output: list[tuple[bytes | None, bytes | None]] = []
            started = time.perf_counter()
            runner = threading.Thread(
                target=lambda: output.append(api.exec_start(exec_id, demux=True)), daemon=True
            )
            runner.start()
            runner.join(timeout)
            timed_out = runner.is_alive()
            if timed_out:
                pid = api.exec_inspect(exec_id).get("Pid", 0)
                if pid:
                    _kill_tree(int(pid))
                runner.join(30)
            duration = time.perf_counter() - started
            info = api.exec_inspect(exec_id)
            stdout, stderr = output[0] if output else (b"", b"")
            self.prefix += 1
            return ExecResult(
                (stdout or b"").decode(errors="replace"),
                (stderr or b"").decode(errors="replace"),
                int(info.get("ExitCode") if info.get("ExitCode") is not None else -1),
                duration,
                timed_out,
            )

    @contextlib.contextmanager
    def action_boundary(self) -> Iterator[None]:
        """Hold the sandbox between actions (a checkpoint asked for mid-action waits here)."""
        with self._boundary:
            yield

    # -- fault injection and life cycle ----------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the container's processes (a fail-stop container failure)."""
        self.container.kill()

    def stop(self, timeout: int = 1) -> None:
        """Stop the container."""
        self.container.stop(timeout=timeout)

    def pause(self) -> None:
        """Freeze the container's processes."""
        self.container.pause()

    def remove(self) -> None:
        """Remove the container (forcefully); idempotent."""
        self.engine.remove(self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()
