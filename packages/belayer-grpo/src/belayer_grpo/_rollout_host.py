"""The rollout host: the router and the slots in a process of their own, which outlives the trainer.

With ``system.resume_grace_s > 0`` the trainer does not run the router and the slot supervisors
itself: it starts ``python -m belayer_grpo._rollout_host RUN_DIR TRAINER_PID`` (a session of its
own, so a Ctrl-C to the trainer's process group does not reach it; on one machine before the
trainer prepares, `prespawn`, so that the host's imports overlap that), which runs `RolloutSystem` exactly as
the trainer would (`ClusterSystem` on Ray with ``cluster.nodes`` or ``cluster.address``: the host is
then the Ray driver, `belayer_grpo._cluster.hosted`), writes ``rollout-host/host.json`` (its pid,
the router's URL and admin token, the slots) once every slot serves, and answers a few calls on
``rollout-host/control.sock`` (one JSON line each way): ``keep_weights``, ``kill_main`` (chaos),
``status`` and ``stop`` (and a cluster's weight pushes, node chaos, events: `CLUSTER_OPS`).  The
trainer sees it as `HostSystem` (`HostedCluster`), which answers the calls of `RolloutSystem`
(`ClusterSystem`).

When the trainer is killed the host keeps running: the router keeps every request it was sent
(finished ones whole, interrupted ones up to their last token) and the slots keep the weights they
serve.  The run's guardian waits ``resume_grace_s`` for a trainer to take the lease
(`belayer_grpo._lease`); ``belayer-grpo train --resume RUN_DIR`` does, and re-attaches
(`HostSystem.adopt`) instead of starting a new rollout side.  Nobody in time: the guardian reaps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from belayer_grpo._config import Config
from belayer_grpo._errors import SystemStartError
from belayer_grpo._lease import host_dir, host_info, pid_alive, set_lease
from belayer_router import RouterClient

if TYPE_CHECKING:
    from anyio.abc import SocketStream

    from belayer_grpo._cluster.system import ClusterSystem
    from belayer_grpo._system import RolloutSystem
    from belayer_shadow import ModelConfig

__all__ = ["HostSlot", "HostSystem", "prespawn", "stop_prespawned"]


@attrs.frozen
class _SlotName:
    slot: str


def _call(control: Path, request: dict[str, Any], timeout_s: float = 120.0) -> Any:
    """One call to the host's control socket; its ``result``, or `SystemStartError` with its error."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as link:
        link.settimeout(timeout_s)
        try:
            link.connect(str(control))
            link.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = link.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError as error:
            raise SystemStartError(
                f"the rollout host at {control} does not answer ({error}); see {control.parent / 'host.log'}"
            ) from error
    reply = json.loads(data) if data else {"error": "the rollout host closed the connection"}
    if "error" in reply:
        raise SystemStartError(f"the rollout host failed {request['op']!r}: {reply['error']}")
    return reply.get("result")


@attrs.define
class HostSlot:
    """A slot of the rollout host, as the training loop sees a slot (name, chaos kill, weights kept)."""

    config: _SlotName
    run_dir: Path
    control: Path

    def kill_main(self) -> float:
        """SIGKILL the slot's main worker (its shadow takes over); the wall-clock time it was sent."""
        return float(_call(self.control, {"op": "kill_main", "slot": self.config.slot}))

    def keep_weights(self, source: Path, version: int | None = None) -> None:
        """belayer-shadow's `SlotSupervisor.keep_weights`, run by the host."""
        _call(
            self.control,
            {"op": "keep_weights", "slot": self.config.slot, "source": str(source), "version": version},
        )

    def events(self) -> list[dict[str, Any]]:
        """The slot's events (its supervisor's log file)."""
        from belayer_shadow import read_events

        return read_events(self.run_dir / "events.jsonl")


@attrs.define
class HostSystem:
    """The trainer's face of a rollout host: the same calls as `RolloutSystem`."""

    router_url: str
    admin_token: str
    slots: list[HostSlot]
    weight_sockets: list[Path]
    run_dir: Path
    pid: int
    adopted: bool = False

    @classmethod
    def _from_info(cls, run_dir: Path, info: dict[str, Any], adopted: bool) -> HostSystem:
        control = host_dir(run_dir) / "control.sock"
        slots = [HostSlot(_SlotName(name), run_dir / "slots" / name, control) for name in info["slots"]]
        sockets = [Path(path) for path in info["weight_sockets"]]
        return cls(info["url"], info["admin_token"], slots, sockets, run_dir, int(info["pid"]), adopted)

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        config: Config,
        run_dir: Path,
        model_config: ModelConfig,
        weights_file: Path,
        process: subprocess.Popen[bytes] | None = None,
    ) -> AsyncIterator[HostSystem]:
        """Start a rollout host serving ``weights_file`` (in ``process``, from `prespawn`, when
        given); stop it at exit (shielded)."""
        folder = host_dir(run_dir)
        if process is None:
            process = prespawn(run_dir)
        spec = {"config": config.to_dict(), "model": model_config.to_dict(), "weights": str(weights_file)}
        aside = folder / ".spec.json.tmp"  # whole or absent: the host may be polling for it
        aside.write_text(json.dumps(spec))
        os.replace(aside, folder / "spec.json")
        try:
            deadline = time.monotonic() + config.system.start_timeout_s * 2 + 60
            while (info := host_info(run_dir)) is None:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemStartError(
                        f"the rollout host did not start (exit status {process.poll()}); see {folder / 'host.log'}"
                    )
                await anyio.sleep(0.05)
            system = cls._from_info(run_dir, info, adopted=False)
            yield system
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_stop_host, folder, process.pid, process)

    @classmethod
    @asynccontextmanager
    async def adopt(cls, run_dir: Path) -> AsyncIterator[HostSystem]:
        """Re-attach to the rollout host a killed trainer left (its lease already taken); stop it at exit."""
        info = host_info(run_dir)
        if info is None:
            raise SystemStartError(f"the rollout host of {run_dir} is gone; resume again (a new one starts)")
        system = cls._from_info(run_dir, info, adopted=True)
        _call(host_dir(run_dir) / "control.sock", {"op": "status"})  # it answers: the slots are there
        try:
            yield system
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_stop_host, host_dir(run_dir), system.pid, None)

    def client(self, timeout_s: float = 600.0, multiplex: bool = True) -> RouterClient:
        """A router client for rollouts (use as ``async with``), as `RolloutSystem.client`."""
        return RouterClient(self.router_url, self.admin_token, timeout_s=timeout_s, multiplex=multiplex)

    def events(self) -> list[dict[str, Any]]:
        """Every slot's events, each tagged with its slot, in time order."""
        merged = [{**event, "slot": slot.config.slot} for slot in self.slots for event in slot.events()]
        return sorted(merged, key=lambda event: float(event.get("time", 0.0)))

    def _status(self) -> dict[str, Any]:
        return dict(_call(host_dir(self.run_dir) / "control.sock", {"op": "status"}))

    def num_handovers(self) -> int:
        """Completed handovers (or conventional restarts) over all slots."""
        return int(self._status()["num_handovers"])

    def healthy_slots(self) -> list[int]:
        """Indices of slots still in service."""
        return [int(index) for index in self._status()["healthy"]]


def prespawn(run_dir: Path) -> subprocess.Popen[bytes]:
    """Start the rollout host's process (this trainer its lease holder) before the trainer has the
    weights it serves: its Python, imports and torch (a few seconds, more on a busy machine) then
    overlap the trainer's preparation; it waits for the spec `HostSystem.start` writes.  Stop it
    with `stop_prespawned` when the run ends before that."""
    folder = host_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host.json", "control.sock", "spec.json"):  # an earlier run's
        (folder / name).unlink(missing_ok=True)
    set_lease(run_dir, os.getpid())
    return _spawn(run_dir)


def stop_prespawned(process: subprocess.Popen[bytes]) -> None:
    """Stop a `prespawn`ed host that never got its spec (SIGTERM ends it while it waits)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _spawn(run_dir: Path) -> subprocess.Popen[bytes]:
    """``python -m belayer_grpo._rollout_host RUN_DIR TRAINER_PID`` in a session of its own (a Ctrl-C to the
    trainer's process group does not reach it; the trainer stops it), logging to ``host.log``."""
    with (host_dir(run_dir) / "host.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "belayer_grpo._rollout_host", str(run_dir), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip


def _stop_host(folder: Path, pid: int, process: subprocess.Popen[bytes] | None) -> None:
    """Ask the host to stop its slots and router (a SIGTERM when it does not answer); SIGKILL it
    after 60 s (the slots' own guardians then reap their processes)."""
    if (folder / "control.sock").exists():
        with contextlib.suppress(SystemStartError, ValueError):
            _call(folder / "control.sock", {"op": "stop"}, timeout_s=10.0)
    else:
        with contextlib.suppress(ProcessLookupError):  # not serving yet: SIGTERM stops it
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while (process.poll() is None) if process is not None else pid_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if process is not None:
                process.wait()
            break
        time.sleep(0.05)


async def _answer(system: RolloutSystem | ClusterSystem, request: dict[str, Any]) -> Any:
    from belayer_grpo._cluster.hosted import CLUSTER_OPS, answer_cluster
    from belayer_grpo._cluster.system import ClusterSystem

    op = request.get("op")
    if op == "status":  # a cluster's reads its slots' events from their nodes: in a thread
        healthy, num_handovers = await anyio.to_thread.run_sync(
            lambda: (system.healthy_slots(), system.num_handovers())
        )
        return {"healthy": healthy, "num_handovers": num_handovers}
    if op == "stop":
        return None  # `handle` sets ``stop`` once the answer is sent
    if isinstance(system, ClusterSystem):
        if op in CLUSTER_OPS:
            return await answer_cluster(system, request)
        if op == "kill_main":
            remote = next(s for s in system.slots if s.config.slot == request.get("slot"))
            return await anyio.to_thread.run_sync(remote.kill_main)
        raise ValueError(f"unknown call {op!r} (a cluster's rollout host)")
    slot = next(s for s in system.slots if s.config.slot == request.get("slot"))
    if op == "kill_main":
        return await anyio.to_thread.run_sync(slot.kill_main)
    if op == "keep_weights":
        source, version = Path(request["source"]), request.get("version")
        await anyio.to_thread.run_sync(slot.keep_weights, source, version)
        return None
    raise ValueError(f"unknown call {op!r}")


async def _spec(folder: Path, trainer_pid: int) -> dict[str, Any]:
    """The trainer's spec (`HostSystem.start`).  Started early (`prespawn`), the host imports what
    its slots need first (their supervisor fills the weight server with torch), then waits for it;
    it exits when the trainer that started it is gone before sending it."""
    path = folder / "spec.json"
    if not path.exists():
        import belayer_shadow

        started = time.monotonic()
        belayer_shadow.SlotSupervisor  # noqa: B018 (the import is the point)
        imported = time.monotonic()
        while not path.exists():
            if not pid_alive(trainer_pid):
                raise SystemExit("belayer-grpo rollout host: the trainer is gone before it sent the spec")
            await anyio.sleep(0.02)
        # (the wait > 0: the import was hidden behind the trainer's preparation)
        print(f"belayer-grpo rollout host: imported the slot supervisor in {imported - started:.2f} s, "
              f"then waited {time.monotonic() - imported:.2f} s for the trainer's spec", file=sys.stderr, flush=True)  # fmt: skip
    return dict(json.loads(path.read_text()))


async def _serve(run_dir: Path, trainer_pid: int) -> None:
    from belayer_grpo._cluster.system import ClusterSystem, cluster_wanted
    from belayer_grpo._config import config_from_dict
    from belayer_grpo._system import RolloutSystem
    from belayer_shadow import ModelConfig

    folder = host_dir(run_dir)
    spec = await _spec(folder, trainer_pid)
    config = config_from_dict(spec["config"])
    model_config = ModelConfig.from_dict(spec["model"])
    stop = anyio.Event()
    # On Ray this process is the driver: the cluster, the router and every actor are its own.
    start: Callable[..., AbstractAsyncContextManager[RolloutSystem | ClusterSystem]] = (
        ClusterSystem.start if cluster_wanted(config) else RolloutSystem.start
    )
    async with start(config, run_dir, model_config, Path(spec["weights"])) as system:

        async def handle(stream: SocketStream) -> None:
            async with stream:
                data = b""
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while not data.endswith(b"\n"):
                        data += await stream.receive()
                if not data.endswith(b"\n"):
                    return  # the caller went away before its request was whole
                request = json.loads(data)
                try:
                    reply = {"result": await _answer(system, request)}
                except Exception as error:  # the caller raises it: one bad call does not end the host
                    reply = {"error": f"{type(error).__name__}: {error}"}
                # A call of a trainer SIGKILLed meanwhile (an agentic run's sandbox calls are in
                # flight at any moment) has nobody to answer: that must not end the host.
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await stream.send(json.dumps(reply).encode() + b"\n")
                if request.get("op") == "stop":
                    stop.set()

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    stop.set()

        control = folder / "control.sock"
        control.unlink(missing_ok=True)
        listener = await anyio.create_unix_listener(control)
        info = {
            "pid": os.getpid(), "url": system.router_url, "admin_token": system.admin_token,
            "slots": [slot.config.slot for slot in system.slots], "weight_sockets": [str(p) for p in system.weight_sockets],
            "cluster": isinstance(system, ClusterSystem),
        }  # fmt: skip
        aside = folder / ".host.json.tmp"
        aside.unlink(missing_ok=True)
        # It holds the router's admin token (weight updates, unhealthy marks): the owner's only.
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(info))
        os.replace(aside, folder / "host.json")
        async with listener, anyio.create_task_group() as group:
            group.start_soon(listener.serve, handle)
            group.start_soon(on_signal)
            await stop.wait()
            group.cancel_scope.cancel()
        # Nothing interrupts the slots' stop now (a late SIGTERM would kill this process mid-way).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        (folder / "host.json").unlink(missing_ok=True)
        control.unlink(missing_ok=True)


if __name__ == "__main__":
    anyio.run(_serve, Path(sys.argv[1]), int(sys.argv[2]))
