"""`SparePool`: started containers kept ready, so a fresh-runtime restore skips create and start.

The runtime of a ``fresh-runtime`` checkpoint is by definition the image's stateless init started
anew.  A spare created and started ahead of time from the same image and configuration holds just
that; a restore takes it, replays the checkpoint's layer through its merged root
(`_layer_apply`) and hands it over, and a new spare is made in the background.  A spare is used
only when it is still exactly as it started (running, same init, same image, writable layer
unchanged) and the layer can be replayed exactly; otherwise the restore takes the normal path.

A pool is per (configuration, trajectory) by default: each spare carries its trajectory's label,
as a normal restore's container does.  A ``shared`` pool (one per run) keys its spares by
configuration alone, so any trajectory's checkpoint of that configuration can take one: its spares
carry the configuration's labels (a run's label, which its reaper looks for) and the trajectory
label ``spare``, which Docker cannot change later; the restored `Sandbox` object carries the
checkpoint's trajectory (`Sandbox.trajectory`), which is what envckpt reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ._docker import Engine
from ._errors import BelayerEnvckptError
from ._layer import layer_digest
from ._layer_apply import apply_layer, plan_apply
from ._procfs import HOST_PROC_ENV, host_proc
from ._sandbox import Sandbox, SandboxConfig

SHARED_TRAJECTORY = "spare"  # the trajectory label of a shared pool's spares


def _config_key(config: SandboxConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


@attrs.define
class _Spare:
    sandbox: Sandbox
    image_id: str
    init_pid: int
    upper_digest: str


@attrs.define(eq=False)
class SparePool:
    """Up to ``size`` started spares per (configuration, trajectory), for `full_restore(spares=)`.

    ``warm(config, trajectory)`` fills the pool now; a restore that takes a spare (or finds none)
    asks for a new one in a background thread, off the restore's path.  ``close()`` waits for
    those threads and removes every spare.  Thread-safe.

    ``shared``: up to ``size`` spares per configuration, taken by any trajectory's restore (the
    ``trajectory`` arguments are then ignored but for the `Sandbox` handed over); the spares are
    created with the trajectory label ``spare`` and the configuration's own labels.
    """

    engine: Engine
    size: int = 1
    shared: bool = False
    _spares: dict[tuple[str, str], list[_Spare]] = attrs.field(factory=dict, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _threads: list[threading.Thread] = attrs.field(factory=list, init=False)
    _pending: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    def _key(self, config: SandboxConfig, trajectory: str) -> tuple[str, str]:
        return _config_key(config), "" if self.shared else trajectory

    def warm(self, config: SandboxConfig, trajectory: str = "") -> None:
        """Create and start spares for ``config`` until the pool holds ``size`` of them."""
        key = self._key(config, trajectory)
        while True:
            with self._lock:
                if self._closed or len(self._spares.get(key, [])) + self._pending.get(key, 0) >= self.size:
                    return
                self._pending[key] = self._pending.get(key, 0) + 1
            try:
                spare = self._make(config, trajectory)
            finally:
                with self._lock:
                    self._pending[key] -= 1
            with self._lock:
                if not self._closed:
                    self._spares.setdefault(key, []).append(spare)
                    continue
            spare.sandbox.remove()
            return

    def refill_later(self, config: SandboxConfig, trajectory: str = "") -> None:
        """Start a background thread that `warm`s the pool (its errors are dropped)."""

        def run() -> None:
            # A failed refill only means the next restore finds no spare and takes the normal path.
            with contextlib.suppress(BelayerEnvckptError):
                self.warm(config, trajectory)

        thread = threading.Thread(target=run, name="belayer-spare-refill", daemon=True)
        with self._lock:
            if self._closed:
                return
            # Started under the lock: `close` never joins a thread not yet started (RuntimeError),
            # and the next call's clean-up (not alive) never drops one that is about to run.
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Wait for the background refills started so far (benchmarks, tests)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def take(self, config: SandboxConfig, trajectory: str = "") -> Sandbox | None:
        """A spare exactly as it started (removed from the pool), or None; stale ones are removed.

        The spare handed over is ``trajectory``'s (`Sandbox.trajectory`), also from a shared pool.
        """
        key = self._key(config, trajectory)
        while True:
            with self._lock:
                spares = self._spares.get(key, [])
                if not spares:
                    return None
                spare = spares.pop(0)
            if self._unchanged(spare, config):
                spare.sandbox.trajectory = trajectory
                return spare.sandbox
            spare.sandbox.remove()

    def count(self, config: SandboxConfig, trajectory: str = "") -> int:
        """How many spares are ready for ``config`` now."""
        with self._lock:
            return len(self._spares.get(self._key(config, trajectory), []))

    def retain(self, configs: Iterable[SandboxConfig]) -> int:
        """Remove the ready spares of every configuration not in ``configs`` (a run whose
        trajectories change image keeps spares only for those in use); how many were removed."""
        keep = {_config_key(config) for config in configs}
        with self._lock:
            dropped = [key for key in self._spares if key[0] not in keep]
            spares = [spare for key in dropped for spare in self._spares.pop(key)]
        for spare in spares:
            spare.sandbox.remove()
        return len(spares)

    def close(self) -> None:
        """Wait for the background refills, then remove every spare."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for thread in threads:
            thread.join(120.0)
        with self._lock:
            spares = [s for group in self._spares.values() for s in group]
            self._spares.clear()
        for spare in spares:
            spare.sandbox.remove()

    def __enter__(self) -> SparePool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _make(self, config: SandboxConfig, trajectory: str) -> _Spare:
        label = SHARED_TRAJECTORY if self.shared else trajectory
        sandbox = Sandbox.create(self.engine, config, trajectory=label)
        try:
            attrs_ = sandbox.inspect()
            upper = self.engine.upper_dir(sandbox._container)
            return _Spare(sandbox, str(attrs_["Image"]), int(attrs_["State"]["Pid"]), layer_digest(upper))
        except (BelayerEnvckptError, OSError, KeyError, ValueError):
            sandbox.remove()
            raise

    def _unchanged(self, spare: _Spare, config: SandboxConfig) -> bool:
        try:
            attrs_: dict[str, Any] = spare.sandbox.inspect()
            state = attrs_.get("State", {})
            return (
                state.get("Status") == "running"
                and int(state.get("Pid") or 0) == spare.init_pid
                and str(attrs_.get("Image")) == self.engine.image_id(config.image)
                and layer_digest(self.engine.upper_dir(spare.sandbox._container)) == spare.upper_digest
            )
        except (BelayerEnvckptError, OSError, ValueError):
            return False


def merged_dir(sandbox: Sandbox) -> Path:
    """The running container's merged overlay root, as this process reaches it: the daemon's
    ``MergedDir`` on the host.  A process in a mount namespace of its own (a sandbox host on an
    isolated node of belayer-cluster, with `BELAYER_ENVCKPT_HOST_PROC`) does not see the overlays
    the daemon mounted after that namespace was made (an empty folder is there): it reaches the
    container's root through its init's ``root`` in the host's procfs instead."""
    if os.environ.get(HOST_PROC_ENV):
        return Path(host_proc(), str(int(sandbox.inspect()["State"]["Pid"])), "root")
    data = sandbox._container.attrs.get("GraphDriver", {}).get("Data", {})
    return Path(data["MergedDir"])


def _crosses_a_mount(root: Path, members: Sequence[tarfile.TarInfo]) -> bool:
    """Whether a member lies on or under a mount of the container's own (``/etc/hosts``, ``/dev``,
    ...) seen through its init's procfs ``root``: written there it would change the mounted file,
    which a normal restore leaves as the engine made it."""
    if root.name != "root" or not root.parent.name.isdigit():
        return False  # the daemon's MergedDir: the container's own mounts are not on it
    try:
        lines = (root.parent / "mountinfo").read_text().splitlines()
    except OSError:
        return True
    points = {line.split()[4].strip("/") for line in lines if len(line.split()) > 4} - {""}
    for member in members:
        name = os.path.normpath(member.name).strip("/")
        if any(name == point or name.startswith(point + "/") for point in points):
            return True
    return False


def restore_into_spare(
    pool: SparePool,
    archive: Path,
    members: Sequence[tarfile.TarInfo],
    config: SandboxConfig,
    trajectory: str,
    timings: dict[str, float],
) -> Sandbox | None:
    """A spare of ``pool`` holding ``archive``'s layer, or None (nothing touched) for the normal path.

    The pool is asked for a new spare in the background whatever happens.
    """
    started = time.perf_counter()
    plan = plan_apply(
        members, command=config.command, working_dir=config.working_dir, path_env=config.env.get("PATH", "")
    )
    if plan is None:
        return None
    sandbox = pool.take(config, trajectory)
    pool.refill_later(config, trajectory)
    if sandbox is None:
        return None
    env = sandbox._container.attrs.get("Config", {}).get("Env") or []
    path_env = next((e[5:] for e in env if e.startswith("PATH=")), "")
    if (
        path_env
        and plan_apply(members, command=config.command, working_dir=config.working_dir, path_env=path_env)
        is None
    ):
        sandbox.remove()
        return None
    taken_ms = round((time.perf_counter() - started) * 1000.0, 3)
    step = time.perf_counter()
    try:
        root = merged_dir(sandbox)
        if _crosses_a_mount(root, members):
            sandbox.remove()
            return None
        apply_layer(archive, root, plan)
    except (BelayerEnvckptError, OSError, KeyError, ValueError):
        sandbox.remove()  # half applied: no one may use it
        return None
    # Only a restore that went into a spare reports `spare_ms` (a fallback reports the normal path's).
    timings["spare_ms"] = taken_ms
    timings["layer_ms"] = round((time.perf_counter() - step) * 1000.0, 3)
    return sandbox
