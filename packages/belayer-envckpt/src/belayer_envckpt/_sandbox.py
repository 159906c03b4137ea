"""Sandbox containers: created inside the guarantee, with actions that count prefix boundaries."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from docker.models.containers import Container

from ._boundary import engine_errors
from ._docker import LABEL, Engine
from ._errors import ContainerEngineError, ContainerNotFoundError, InvalidConfigError, OutsideGuaranteeError
from ._exec import ExecResult, exec_in, signal_in_container
from ._ids import validate_id
from ._limit_guard import LimitGuard, init_killed_error
from ._limits import LIMITS_LABEL, LimitCause, SandboxLimits, enforced_limits, limits_of
from ._reuse import reuse_reset_argv

TRAJECTORY_LABEL = "belayer.trajectory"
KEEPALIVE = ("/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done")


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _str_dict(value: Mapping[str, str]) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()}


def _limits(value: SandboxLimits | Mapping[str, Any]) -> SandboxLimits:
    return value if isinstance(value, SandboxLimits) else SandboxLimits.from_dict(value)


@attrs.frozen
class SandboxConfig:
    """How a sandbox container is created; stored in every checkpoint to recreate it exactly."""

    image: str = attrs.field()
    command: tuple[str, ...] = attrs.field(default=KEEPALIVE, converter=_str_tuple)
    working_dir: str = "/"
    env: dict[str, str] = attrs.field(factory=dict, converter=_str_dict)
    user: str = ""
    hostname: str = "sandbox"
    labels: dict[str, str] = attrs.field(factory=dict, converter=_str_dict)
    limits: SandboxLimits = attrs.field(factory=SandboxLimits, converter=_limits)

    @image.validator
    def _check_image(self, _attr: object, value: str) -> None:
        if not value:
            raise InvalidConfigError("image: give a local image name such as belayer/busybox")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the command as a list, as it reads back from JSON)."""
        return attrs.asdict(self, recurse=False) | {
            "command": list(self.command),
            "env": dict(self.env),
            "labels": dict(self.labels),
            "limits": self.limits.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxConfig:
        """Rebuild a configuration from `to_dict` output; unknown keys are an error."""
        data = dict(data)
        if "limits" not in data:  # written before limits existed: such sandboxes had none
            data["limits"] = SandboxLimits.unlimited()
            data.pop("mem_limit", None)
        unknown = set(data) - {f.name for f in attrs.fields(cls)}
        if unknown:
            raise InvalidConfigError(
                f"sandbox config has unknown keys {sorted(unknown)}: it was written by another version "
                "of belayer-envckpt; restore it with that version"
            )
        return cls(**data)


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
    if any(str(o).replace("=", ":") == "seccomp:unconfined" for o in host.get("SecurityOpt") or ()):
        problems.append("seccomp unconfined (needs the engine's default profile)")
    if problems:
        raise OutsideGuaranteeError(
            f"container {name} is outside the checkpoint guarantee: {', '.join(problems)}. "
            "Create sandboxes with `Sandbox.create` (no network, no host mounts, no volumes); "
            "their whole state then lives in the overlay layer and the process tree."
        )


@attrs.define(eq=False)
class Sandbox:
    """One container inside the guarantee; actions and checkpoints exclude each other.

    ``prefix`` counts committed action boundaries: it is ``k`` in the trajectory's prefix.
    """

    engine: Engine
    _container: Container  # docker-py stays inside this package
    config: SandboxConfig
    trajectory: str = ""
    prefix: int = 0
    context_ref: str = ""
    restore_timings_ms: dict[str, float] = attrs.field(factory=dict)
    # How a full restore's CRIU page images reached the engine: 'in-place', 'copied'; '' for none.
    restore_images: str = ""
    _boundary: threading.RLock = attrs.field(factory=threading.RLock, repr=False)
    _limit_counters: tuple[int, int] | None = attrs.field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls, engine: Engine, config: SandboxConfig, *, trajectory: str = "", start: bool = True
    ) -> Sandbox:
        """Create (and by default start) a container with no network and no host mounts."""
        if trajectory:
            validate_id(trajectory, "trajectory")
        labels = {**config.labels, LABEL: "1", LIMITS_LABEL: config.limits.label()}
        if trajectory:
            labels[TRAJECTORY_LABEL] = trajectory
        name = f"belayer-{trajectory or 'sandbox'}-{uuid.uuid4().hex[:8]}"
        with engine_errors(f"creating a sandbox from {config.image!r}", image=config.image):
            container = engine._client.containers.create(
                config.image,
                list(config.command),
                name=name,
                network_mode="none",
                working_dir=config.working_dir,
                environment=config.env,
                user=config.user or None,
                hostname=config.hostname,
                labels=labels,
                **config.limits.create_kwargs(),
            )
        sandbox = cls(engine, container, config, trajectory)
        if start:
            sandbox.start()
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
            labels={
                k: v
                for k, v in (cfg.get("Labels") or {}).items()
                if k not in (LABEL, TRAJECTORY_LABEL, LIMITS_LABEL)
            },
            limits=limits_of(container.attrs),
        )
        return cls(engine, container, config, trajectory, prefix)

    @property
    def id(self) -> str:
        """The container's full id."""
        return str(self._container.id)

    def status(self) -> str:
        """The engine's view: created, running, paused, exited, dead or removed."""
        try:
            self.reload()
        except ContainerNotFoundError:
            return "removed"
        return str(self._container.status)

    def is_running(self) -> bool:
        """Whether the container is running (False when it stopped, died or was removed)."""
        return self.status() == "running"

    def reload(self) -> None:
        """Refresh the engine's view of the container (status, attributes)."""
        with engine_errors("inspecting a sandbox", container=self.id):
            self._container.reload()

    def inspect(self) -> dict[str, Any]:
        """The engine's full description of the container (as `docker inspect` prints it)."""
        self.reload()
        return dict(self._container.attrs)

    def exec(
        self,
        command: str | Sequence[str],
        timeout_s: float = 60.0,
        *,
        workdir: str | None = None,
    ) -> ExecResult:
        """Run one action; it completes (or is killed at ``timeout_s``) before a checkpoint starts.

        A string runs through ``/bin/sh -c``.  The action counts: ``prefix`` grows by one.
        """
        with self._boundary:
            with self.limit_guard() as guard:
                try:
                    result = self._run(command, timeout_s, workdir)
                except ContainerEngineError as exc:
                    if self.limit_failure() is LimitCause.MEMORY:
                        raise init_killed_error(self.config.limits, self.id) from exc
                    raise
            try:
                guard.check(result)
            finally:
                self._limit_counters = guard.after
            self.prefix += 1
            return result

    def probe(
        self, command: str | Sequence[str], timeout_s: float = 60.0, *, workdir: str | None = None
    ) -> ExecResult:
        """Run a read-only command that is not an action (``prefix`` stays): a hash, a listing.

        It still waits for the current action and excludes checkpoints while it runs.
        """
        with self._boundary:
            return self._run(command, timeout_s, workdir)

    def reset_for_reuse(self, timeout_s: float = 30.0) -> bool:
        """Ready this sandbox for another trajectory (a pool's reuse): every process but PID 1
        killed, the contents of ``config.working_dir`` removed (the folder itself stays, so CRIU
        can still checkpoint the sandbox). Files outside the working folder are NOT reset.

        Returns False, having done nothing, when the working folder is "/" (emptying it would wipe
        the container: do not reuse such a sandbox); False when the reset failed or the sandbox
        stopped. Engine failures raise `BelayerEnvckptError` subclasses as every call does.
        """
        if not self.config.working_dir.rstrip("/"):
            return False
        result = self.probe(reuse_reset_argv(self.config.working_dir), timeout_s, workdir="/")
        return result.exit_code == 0 and self.is_running()

    def _run(self, command: str | Sequence[str], timeout_s: float, workdir: str | None) -> ExecResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        return exec_in(
            self.engine._client.api,
            self.id,
            argv,
            workdir=workdir or self.config.working_dir,
            timeout_s=timeout_s,
        )

    # -- limits -----------------------------------------------------------------------------

    def limit_guard(self) -> contextlib.AbstractContextManager[LimitGuard]:
        """Watch the limits around one action: `LimitGuard.check` then raises `SandboxLimitError`."""
        if not self._container.attrs.get("State", {}).get("Pid"):
            self.reload()
        upper = self.engine.upper_dir(self._container) if self.config.limits.disk_mb else None
        guard = LimitGuard(
            self.config.limits,
            self.id,
            int(self._container.attrs.get("State", {}).get("Pid") or 0),
            upper,
            is_oom_killed=lambda: bool(self.inspect().get("State", {}).get("OOMKilled")),
            seen=self._limit_counters,
            in_container=signal_in_container(self.engine._client.api, self.id),
        )
        return guard.watching()

    def limit_failure(self) -> LimitCause | None:
        """`LimitCause.MEMORY` when the sandbox is down because the OOM killer killed its init; else None.

        (An action that hits a limit while the sandbox lives raises `SandboxLimitError` from `exec`.)
        """
        try:
            state = self.inspect().get("State", {})
        except ContainerNotFoundError:
            return None
        return LimitCause.MEMORY if state.get("OOMKilled") and not state.get("Running") else None

    def enforced_limits(self) -> dict[str, Any]:
        """What the engine applies now (from `docker inspect`); equals ``config.limits.engine_view()``."""
        return enforced_limits(self.inspect())

    @contextlib.contextmanager
    def action_boundary(self) -> Iterator[None]:
        """Hold the sandbox between actions (a checkpoint asked for mid-action waits here)."""
        with self._boundary:
            yield

    # -- fault injection and life cycle ----------------------------------------------------

    def start(self) -> None:
        """Start a created container."""
        with engine_errors("starting a sandbox", container=self.id):
            self._container.start()
            self._container.reload()

    def kill(self) -> None:
        """SIGKILL the container's processes (a fail-stop container failure)."""
        with engine_errors("killing a sandbox", container=self.id):
            self._container.kill()

    def stop(self, timeout_s: int = 1) -> None:
        """Stop the container (SIGTERM, then SIGKILL after ``timeout_s``)."""
        with engine_errors("stopping a sandbox", container=self.id):
            self._container.stop(timeout=timeout_s)

    def pause(self) -> None:
        """Freeze the container's processes."""
        with engine_errors("pausing a sandbox", container=self.id):
            self._container.pause()

    def unpause(self) -> None:
        """Thaw a paused container."""
        with engine_errors("unpausing a sandbox", container=self.id):
            self._container.unpause()

    def remove(self) -> None:
        """Remove the container (forcefully); idempotent."""
        self.engine.remove(self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()
