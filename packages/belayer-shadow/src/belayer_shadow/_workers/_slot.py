"""`SlotSupervisor`: one engine slot's memory servers, main worker and shadow, kept serving.

Shadow recovery: the supervisor reaps the main worker (a blocking `waitpid` in a thread) and
raises the handover flag the moment it exits; the shadow takes over; then the supervisor kills
any residual main and starts a fresh shadow. A second failure within `failure_window_s` of a
handover marks the slot unhealthy at the router (its requests move to healthy slots) and keeps
it out. A lost memory server (exited, or `memory_misses` pings unanswered) is no GPU failure and
no shadow can serve without it: the slot restarts from scratch (new memory servers, the current
weights reloaded from `kept_weights` or the start's checkpoint, a new main and shadow); the
router resumes the interrupted streams on the new main, token-exact; a second failure within the
window marks the slot unhealthy as any other. The restart baselines (`_baseline.py`) run behind
the same supervisor: `conventional`
(health checks, restart, regenerate) and `restart` (the same instant `waitpid` detection as the
shadow, restart from scratch, token-level resume through the router).

Nothing orphaned (`_processes`): workers are forked by one long-lived spawner thread with a
parent-death signal and lead their own process groups; every child is recorded in
`run_dir/processes.json`; a guardian process kills them all if the supervisor dies without
`stop()`; `start()` first reaps what an earlier killed supervisor left in the same run folder.

The API is synchronous (threads); from async code call `start`/`stop` via `anyio.to_thread`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from signal import SIGKILL
from typing import Any

import anyio
import attrs

from belayer_gpumem import BelayerGpumemError, ServerConfig, ServerProcess, ping
from belayer_router import RouterClient
from belayer_shadow._engine._config import ModelConfig, kv_layout, weight_layout
from belayer_shadow._engine._loader import (
    fill_weight_server,
    init_weights,
    load_safetensors,
    save_safetensors,
)
from belayer_shadow._workers._baseline import ConventionalRecovery
from belayer_shadow._workers._children import Child, spawn_worker
from belayer_shadow._workers._events import EventLog, read_events
from belayer_shadow._workers._heartbeat import HandoverFlag, HangDetector, Heartbeat
from belayer_shadow._workers._processes import (
    GUARDIAN_ALIVE_FILE,
    PROCESSES_FILE,
    Guardian,
    ProcessTable,
    Spawner,
    die_with_parent,
    reap_stale_processes,
)
from belayer_shadow._workers._slot_config import SlotConfig

__all__ = ["SlotConfig", "SlotSupervisor"]


# Beside the kept weights: the weight server's version they were committed as.
_KEPT_VERSION_FILE = "version"
# Shadows in a row that exit before standing by; then the supervisor stops starting new ones.
_MAX_FAILED_STARTS = 3


@attrs.define(eq=False)
class SlotSupervisor:
    """Starts, watches and recovers one slot; `stop()` leaves no process, socket or memory segment."""

    config: SlotConfig
    log: EventLog = attrs.field(init=False)
    main: Child | None = None
    shadow: Child | None = None
    healthy: bool = True
    num_handovers: int = 0
    last_handover: float | None = None  # monotonic time the latest handover began
    weights_server: ServerProcess | None = None
    kv_server: ServerProcess | None = None
    _generation: int = 0
    _lock: threading.RLock = attrs.field(factory=threading.RLock)
    _stopping: threading.Event = attrs.field(factory=threading.Event)
    _monitor: threading.Thread | None = None
    _conventional: ConventionalRecovery | None = None
    _restart_due: threading.Event = attrs.field(factory=threading.Event)
    _handover_generation: int | None = None
    _children: list[Child] = attrs.field(factory=list)
    _num_failed_starts: int = 0
    _spawner: Spawner | None = None
    _processes: ProcessTable | None = None
    _guardian: Guardian | None = None
    _kept_weights: Path | None = None
    _memory_misses: int = 0
    _recovering: bool = False  # a restart for lost memory runs: a main exiting meanwhile is part of it
    # The memory servers are down or being refilled (a restart from scratch): a weight update
    # skips the slot and only keeps its folder, which the refill loads (`keep_weights_if_out`).
    _memory_out: bool = False
    _kept_generation: int = 0  # bumped by every keep_weights: a refill rereads a newer copy
    _next_memory_check: float = 0.0
    # "shadow" / "guardian": (pid, its hang detector) of the process being watched.
    _watches: dict[str, tuple[int, HangDetector]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.log = EventLog(self.config.run_dir / "events.jsonl", "supervisor")

    # Paths.

    @property
    def weights_socket(self) -> Path:
        """The weight server's socket: push new weights here with gpumem's `WeightClient`."""
        return self.config.run_dir / "mem" / "weights.sock"

    @property
    def kv_socket(self) -> Path:
        """The KV server's socket."""
        return self.config.run_dir / "mem" / "kv.sock"

    @property
    def checkpoint(self) -> Path:
        """The safetensors file (or folder) the weight server loads at a start or a restart from
        scratch: the weights last kept with `keep_weights`, else the configured or seeded ones."""
        if self._kept_weights is not None:
            return self._kept_weights
        return self.config.weights or self.config.run_dir / "init.safetensors"

    def keep_weights(self, source: Path, version: int | None = None) -> None:
        """Keep a copy of the weights just committed to the weight server (a `*.safetensors` file
        or a folder of them), so a restart from scratch reloads this version, not the first.

        `version`: the weight server's version of that commit (what `fill_weight_server` or a
        `WeightClient` commit returned); a restart from scratch then brings the new server back
        at this version, not at 1 (the trainer's and the router's version checks see no step back).

        A copy, not the path: a trainer may overwrite or delete its folder at the next step. The
        copy replaces the previous one atomically (written aside, then renamed)."""
        source = Path(source)
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
        kept = self.config.run_dir / "kept-weights"
        aside = self.config.run_dir / "kept-weights.new"
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir(parents=True)
        for file in files:
            shutil.copyfile(file, aside / file.name)
        if version is not None:
            (aside / _KEPT_VERSION_FILE).write_text(f"{int(version)}\n")
        with self._lock:
            old = self.config.run_dir / "kept-weights.old"
            shutil.rmtree(old, ignore_errors=True)
            if kept.exists():
                kept.rename(old)
            aside.rename(kept)
            shutil.rmtree(old, ignore_errors=True)
            self._kept_weights = kept
            self._kept_generation += 1
        self.log.emit("weights.kept", source=str(source), num_files=len(files), version=version)

    def adopt_kept_weights(self) -> int | None:
        """Take the weights an earlier supervisor of this run folder kept (`keep_weights`), as a
        supervisor started again after its predecessor died does: the start then loads them, at
        their version. Returns that version (None if it was not recorded); without kept weights
        (none, or a copy left half-written) nothing changes and None is returned. Call before
        `start`."""
        kept = self.config.run_dir / "kept-weights"
        previous = self.config.run_dir / "kept-weights.old"
        if not kept.is_dir() and previous.is_dir():
            # It died between `keep_weights`' two renames: the copy set aside then is complete
            # (written before the renames) and holds the newer weights, committed already.
            aside = self.config.run_dir / "kept-weights.new"
            (aside if aside.is_dir() else previous).rename(kept)
        if not kept.is_dir() or not any(kept.glob("*.safetensors")):
            return None
        with self._lock:
            self._kept_weights = kept
        version = self.kept_version
        self.log.emit("weights.adopted", path=str(kept), version=version)
        return version

    @property
    def kept_version(self) -> int | None:
        """The weight server's version of the weights last kept, if `keep_weights` was told it."""
        if self._kept_weights is None:
            return None
        try:
            return int((self._kept_weights / _KEPT_VERSION_FILE).read_text())
        except (OSError, ValueError):
            return None

    def accepts_weights(self) -> bool:
        """Whether a weight update can be written to this slot's weight server now: the slot is
        healthy, no restart from scratch is tearing down or refilling its memory, and the weight
        server process is alive. (A stopped server passes; the update's attach timeout fails it.)"""
        with self._lock:
            server = self.weights_server
            return self.healthy and not self._memory_out and server is not None and server.alive()

    def keep_weights_if_out(self, source: Path) -> bool:
        """If the slot is out (`accepts_weights` False), keep `source` as its current weights and
        return True: a restart under way reloads it (the refill rereads a copy kept while it
        ran), a later one loads it. Else return False and keep nothing (write the server)."""
        with self._lock:  # held through the copy: a refill cannot finish between check and keep
            if self.accepts_weights():
                return False
            self.keep_weights(source)
            self.log.emit("weights.skipped", source=str(source), healthy=self.healthy)
            return True

    @property
    def heartbeat(self) -> Path:
        """The slot's heartbeat file."""
        return self.config.run_dir / "heartbeat"

    @property
    def shadow_alive(self) -> Path:
        """The file a standby shadow touches at every poll (`standby_stale_s` old: it hangs)."""
        return self.config.run_dir / "shadow.alive"

    @property
    def guardian_alive(self) -> Path:
        """The file the guardian touches every 0.5 s (`standby_stale_s` old: it hangs)."""
        return self.config.run_dir / GUARDIAN_ALIVE_FILE

    @property
    def flag(self) -> HandoverFlag:
        """The slot's handover flag."""
        return HandoverFlag(self.config.run_dir / "handover.flag")

    @property
    def main_url(self) -> str | None:
        """The URL the current main worker registered."""
        state = None if self.main is None else self.main.state()
        return None if state is None else state.get("url")

    @property
    def epoch(self) -> int | None:
        """The epoch of the current main worker."""
        state = None if self.main is None else self.main.state()
        return None if state is None else state.get("epoch")

    def emit(self, event: str, **fields: Any) -> None:
        """Append a supervisor event to the slot's event log."""
        self.log.emit(event, **fields)

    def events(self) -> list[dict[str, Any]]:
        """The slot's JSON event log (supervisor, workers and shadows), oldest first."""
        return read_events(self.config.run_dir / "events.jsonl")

    # Life cycle.

    def start(self) -> None:
        """Start memory servers, main worker (and shadow); returns once the main is registered."""
        config = self.config
        config.run_dir.mkdir(parents=True, exist_ok=True)
        reaped = reap_stale_processes(config.run_dir)
        if reaped:
            self.log.emit("stale.reaped", pids=reaped)
        shutil.rmtree(config.run_dir / "mem", ignore_errors=True)
        for stale in (self.heartbeat, self.flag.path, self.shadow_alive, self.guardian_alive):
            stale.unlink(missing_ok=True)
        self._stopping.clear()
        self._processes = ProcessTable(config.run_dir)
        self._spawner = Spawner(f"spawn-{config.slot}")
        try:
            self._guardian = Guardian.start(config.run_dir, self._processes)
            self.start_memory_servers()
            self.main = self._spawn("main", resume_mode="continue")
            if config.recovery == "shadow":
                self.shadow = self._spawn("shadow")
            state = self.main.wait_state({"serving"}, config.start_timeout_s)
            self.log.emit("main.serving", pid=self.main.pid, url=state["url"], epoch=state["epoch"])
        except BaseException:
            self.stop()
            raise
        if config.recovery == "conventional":
            self._conventional = ConventionalRecovery(self, config.health_interval_s, config.health_misses)
        self._monitor = threading.Thread(target=self._watch, name=f"slot-{config.slot}", daemon=True)
        self._monitor.start()

    def wait_protected(self, timeout_s: float = 120.0) -> None:
        """Block until a shadow stands by (shadow recovery) or the main serves (conventional)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                shadow, main = self.shadow, self.main
            if self.config.recovery != "shadow" and main is not None and main.state():
                return
            if shadow is not None and (shadow.state() or {}).get("state") == "standby":
                return
            time.sleep(0.02)
        raise TimeoutError(
            f"slot {self.config.slot!r} not protected within {timeout_s} s; see {self.config.run_dir}"
        )

    def wait_handovers(self, count: int, timeout_s: float = 60.0) -> None:
        """Block until `count` handovers (or conventional restarts) have completed."""
        deadline = time.monotonic() + timeout_s
        while self.num_handovers < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.num_handovers} of {count} handovers within {timeout_s} s")
            time.sleep(0.01)

    def kill_main(self, signal: int = SIGKILL) -> float:
        """Chaos: send `signal` to the main worker; returns the wall-clock time it was sent."""
        assert self.main is not None, "start() the supervisor first"
        sent = time.time()
        os.kill(self.main.pid, signal)
        self.log.emit("chaos.signal", pid=self.main.pid, signal=int(signal))
        return sent

    def stop(self) -> None:
        """Stop every child and memory server, remove sockets and files it made; idempotent."""
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=10)
        with self._lock:
            for child in (self.shadow, self.main):
                if child is not None:
                    child.kill(graceful_s=3.0)
            self.stop_memory_servers()
            children = list(self._children)
        for child in children:  # outside the lock: a reaper's callback takes it
            child.kill()
            if child.reaper is not None:
                child.reaper.join(timeout=10)
        if self._conventional is not None:
            self._conventional.close()
        if self._guardian is not None:
            self._guardian.close(timeout_s=5.0)  # it has nothing left to reap: stop() killed all
            self._guardian = None
        (self.config.run_dir / PROCESSES_FILE).unlink(missing_ok=True)
        if self._spawner is not None:
            self._spawner.close()
        shutil.rmtree(self.config.run_dir / "mem", ignore_errors=True)
        for path in (self.heartbeat, self.flag.path, self.shadow_alive, self.guardian_alive):
            path.unlink(missing_ok=True)

    # Memory servers.

    def start_memory_servers(self) -> None:
        """Allocate the weight region (`weight_layout`'s table, filled from the checkpoint) and the
        KV arena. A checkpoint that does not match the model is a WeightsError here."""
        config = self.config
        model = ModelConfig.default() if config.model is None else ModelConfig.from_json_file(config.model)
        if config.weights is None and not self.checkpoint.exists():
            save_safetensors(init_weights(model, config.seed), self.checkpoint)
        with self.log.step("memory.start"):
            backend, device = config.backend, config.device
            # The table is `weight_layout`'s (fused parts back to back: q|k|v, gate|up), not the
            # checkpoint's sorted names, so that both engines' fused weights are views of it.
            layout_file = self.weights_socket.parent / "weights-layout.json"
            layout_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            layout_file.write_text(json.dumps(weight_layout(model).to_json()))
            # Kept weights of version N: the server starts at N - 1 and their refill commits N.
            kept_version = self.kept_version
            self.weights_server = self._start_server(
                ServerConfig(
                    kind="weights",
                    socket=self.weights_socket,
                    layout_file=layout_file,
                    backend=backend,
                    device=device,
                    start_version=0 if kept_version is None else max(0, kept_version - 1),
                ),
                "weights-server",
            )
            try:
                self._fill_weights()
            except BaseException:
                self.stop_memory_servers()
                raise
            layout = kv_layout(model, config.num_kv_blocks, config.block_size)
            self.kv_server = self._start_server(
                ServerConfig(
                    kind="kv", socket=self.kv_socket, kv_layout=layout, backend=backend, device=device
                ),
                "kv-server",
            )

    def _start_server(self, server: ServerConfig, role: str) -> ServerProcess:
        """Start one memory server so that no kill of this process leaves it behind: forked by the
        spawner thread with the parent-death signal (as the workers), and recorded in
        `processes.json` (for the guardian) before it is waited for, not after."""
        if self._spawner is None:  # not started: a plain child, as belayer-gpumem starts it
            return ServerProcess.start(server)
        parent = os.getpid()
        popen = self._spawner.call(lambda: ServerProcess.spawn(server, preexec_fn=die_with_parent(parent)))
        if self._processes is not None:
            self._processes.add(popen.pid, role, group=False, files=(server.socket,))
        try:
            return ServerProcess.wait_ready(server, popen)
        except BaseException:
            if self._processes is not None:
                self._processes.remove(popen.pid)  # wait_ready killed and reaped it
            raise

    def _fill_weights(self) -> None:
        """Fill the new weight server from the checkpoint; again while an update kept a newer copy
        meanwhile (it skipped this slot); then the slot takes updates directly."""
        while True:
            with self._lock:
                generation, checkpoint = self._kept_generation, self.checkpoint
            fill_weight_server(self.weights_socket, load_safetensors(checkpoint))
            with self._lock:
                if generation == self._kept_generation:
                    self._memory_out = False
                    return

    def stop_memory_servers(self) -> None:
        """SIGTERM both memory servers (they remove their sockets and release their regions)."""
        for server in (self.weights_server, self.kv_server):
            if server is not None:
                server.stop(timeout_s=10)
                if self._processes is not None:
                    self._processes.remove(server.pid)
        self.weights_server = self.kv_server = None

    # Workers.

    def worker_argv(self, role: str, *, resume_mode: str = "continue") -> list[str]:
        """The `belayer-shadow` command line of a `main` or `shadow` worker of this slot.

        The one place that decides which worker process a slot runs (a second engine branches here).
        """
        config = self.config
        argv = [
            "worker" if role == "main" else "shadow",
            *("--slot", config.slot, "--router", config.router_url, "--host", config.host),
            *("--weights-socket", str(self.weights_socket), "--kv-socket", str(self.kv_socket)),
            *("--heartbeat", str(self.heartbeat), "--event-log", str(config.run_dir / "events.jsonl")),
            *("--max-num-seqs", str(config.max_num_seqs), "--resume-mode", resume_mode),
            *("--engine", config.engine),
        ]
        if config.model is not None:
            argv += ["--model", str(config.model)]
        if role == "shadow":
            argv += ["--handover-flag", str(self.flag.path), "--poll-s", str(config.poll_s)]
            argv += ["--stale-s", str(config.stale_s), "--alive-file", str(self.shadow_alive)]
        return argv

    def _spawn(self, role: str, *, resume_mode: str = "continue") -> Child:
        config = self.config
        self._generation += 1
        argv = self.worker_argv(role, resume_mode=resume_mode)
        env = dict(os.environ)
        if config.admin_token is not None:  # by environment, not argv, so `ps` does not show it
            env["BELAYER_ROUTER_ADMIN_TOKEN"] = config.admin_token
        generation = self._generation
        assert self._spawner is not None, "start() the supervisor first"
        child = self._spawner.call(
            lambda: spawn_worker(role, generation, argv, config.run_dir, self._on_exit, env)
        )
        self._children.append(child)
        if self._processes is not None:
            self._processes.add(child.pid, role, group=True)
        self.log.emit(f"{role}.spawned", pid=child.pid, generation=child.generation)
        return child

    def restart_from_scratch(self, cause: str, *, resume_mode: str) -> None:
        """The restart baselines' recovery: kill the main, new memory (weights reloaded), new main.

        Blocks until the new main serves. A second failure within `failure_window_s` takes the
        slot out instead. Events: `<cause>.restart` (all of it), `<cause>.reallocate`.
        """
        if self.second_failure():
            return
        self.last_handover = time.monotonic()
        with self.log.step(f"{cause}.restart"):
            with self._lock:
                self._memory_out = True
                residual = self.main
                if residual is not None and residual.alive():
                    residual.kill()
                    self.log.emit("residual.killed", pid=residual.pid)
                with self.log.step(f"{cause}.reallocate"):
                    self.stop_memory_servers()
                    self.start_memory_servers()
                main = self.main = self._spawn("main", resume_mode=resume_mode)
            main.wait_state({"serving"}, self.config.start_timeout_s)
        with self._lock:
            self.num_handovers += 1

    def _check_guardian(self) -> None:
        """A guardian that died (SIGKILL) or hangs (SIGSTOP: its alive file `standby_stale_s`
        old) is replaced: the slot keeps its no-orphans guarantee."""
        guardian = self._guardian
        if guardian is None or self._processes is None:
            return
        pid = guardian.popen.pid
        if guardian.popen.poll() is not None:
            self.log.emit("guardian.lost", pid=pid, exit_code=guardian.popen.returncode)
            guardian.close(timeout_s=0.0)
        elif self._stale(Heartbeat(self.guardian_alive), pid, "guardian"):
            self.log.emit("guardian.hung", pid=pid, age_s=Heartbeat(self.guardian_alive).age_s())
            guardian.kill()  # first, then its pipe: a slow (not stopped) one must not reap the slot
        else:
            return
        self._guardian = Guardian.start(self.config.run_dir, self._processes)
        self.log.emit("guardian.started", pid=self._guardian.popen.pid)

    def _stale(self, alive: Heartbeat, pid: int, watch: str) -> bool:
        """Whether process `pid`'s alive file went `standby_stale_s` stale (`HangDetector`'s rules:
        it must have been seen fresh, and a late poll of this thread never decides)."""
        if alive.writer_pid() != pid:
            return False  # not touched by this process yet (it is starting)
        current = self._watches.get(watch)
        if current is None or current[0] != pid:
            current = self._watches[watch] = (pid, HangDetector(self.config.standby_stale_s, poll_s=0.01))
        return current[1].is_hung(alive.age_s(), time.monotonic())

    def _check_memory(self) -> None:
        """Restart from scratch if a memory server exited, or missed `memory_misses` pings."""
        with self._lock:
            servers = [("weights", self.weights_server, self.weights_socket)]
            servers.append(("kv", self.kv_server, self.kv_socket))
        exited = [name for name, server, _ in servers if server is not None and not server.alive()]
        if exited:
            self._recover_memory(f"{' and '.join(exited)} server exited")
            return
        now = time.monotonic()
        if now < self._next_memory_check:
            return
        config = self.config
        self._next_memory_check = now + config.memory_check_s
        silent = []
        for name, server, socket_path in servers:
            if server is None:
                continue
            try:
                ping(socket_path, timeout_s=config.memory_check_s)
            except (BelayerGpumemError, OSError):
                silent.append(name)
        self._memory_misses = self._memory_misses + 1 if silent else 0
        if silent:
            self.log.emit("memory.miss", servers=silent, num_misses=self._memory_misses)
        if self._memory_misses >= config.memory_misses:
            self._recover_memory(f"{' and '.join(silent)} server not answering ({self._memory_misses} pings)")

    def _recover_memory(self, cause: str) -> None:
        """The slot's memory is gone (or its shadow is stuck): restart from scratch (or, a second
        failure within the window, take the slot out)."""
        self._memory_misses = 0
        self.log.emit("memory.lost", cause=cause)
        with self._lock:
            self._recovering = True
            self._memory_out = True
            shadow, self.shadow = self.shadow, None
            for server in (self.weights_server, self.kv_server):
                if server is not None:
                    server.kill()  # SIGKILL: a hung (stopped) server ignores SIGTERM
            for path in (self.weights_socket, self.kv_socket):
                path.unlink(missing_ok=True)
        if shadow is not None:
            shadow.kill()  # attached to the lost memory: it could not serve from it
        self.flag.clear()
        self.heartbeat.unlink(missing_ok=True)
        try:
            self.restart_from_scratch("memory", resume_mode="continue")
        finally:
            with self._lock:
                self._recovering = False
                self._restart_due.clear()  # the old main's exit: this restart was its recovery
                self.flag.clear()  # the same, for a flag its reaper raised meanwhile
        if self.healthy and self.config.recovery == "shadow" and not self._stopping.is_set():
            with self._lock:
                self.shadow = self._spawn("shadow")

    def _on_exit(self, child: Child) -> None:
        """Reaper callback: a main that dies unexpectedly raises the handover flag at once."""
        if self._processes is not None:
            self._processes.remove(child.pid)
        with self._lock:
            self.log.emit(f"{child.role}.exited", pid=child.pid, exit_code=child.exit_code)
            if (
                self._stopping.is_set()
                or self._recovering
                or child is not self.main
                or self.config.recovery == "conventional"
            ):
                return
            if self.config.recovery == "restart":
                # Instant detection, as for the shadow; the monitor thread restarts from scratch.
                self.log.emit(
                    "restart.detect", pid=child.pid, exit_code=child.exit_code, exit_time=child.exit_time
                )
                self._restart_due.set()
                return
            shadow_state = None if self.shadow is None else (self.shadow.state() or {}).get("state")
            if shadow_state in ("handover", "serving"):
                return  # the shadow fenced it during a handover
            if self.second_failure():
                return
            self.flag.raise_(
                "main exited", pid=child.pid, exit_code=child.exit_code, exit_time=child.exit_time
            )
            self.log.emit("handover.flag", pid=child.pid)

    def second_failure(self) -> bool:
        """If a handover happened within the window, take the slot out for good; True if so."""
        if self.last_handover is None or time.monotonic() - self.last_handover > self.config.failure_window_s:
            return False
        self.healthy = False
        for child in (self.shadow, self.main):
            if child is not None:
                child.kill()
        self.log.emit("slot.second_failure", window_s=self.config.failure_window_s)
        threading.Thread(target=self.mark_unhealthy, daemon=True).start()
        return True

    def mark_unhealthy(self) -> None:
        """Tell the router to keep this slot out (its requests move to healthy slots)."""
        self.healthy = False

        async def call() -> None:
            async with RouterClient(self.config.router_url, self.config.admin_token, timeout=10.0) as router:
                await router.mark_unhealthy(self.config.slot)

        anyio.run(call)
        self.log.emit("slot.unhealthy", slot=self.config.slot)

    # The monitor thread.

    def _watch(self) -> None:
        while not self._stopping.wait(0.01):
            if not self.healthy:
                continue
            try:
                self._check_guardian()
                self._check_memory()
                if not self.healthy:
                    continue
                if self._conventional is not None:
                    self._conventional.poll()
                elif self._restart_due.is_set():
                    self._restart_due.clear()
                    self.restart_from_scratch("restart", resume_mode="continue")
                else:
                    self._check_shadow()
            except Exception as exc:  # the monitor must outlive a bad poll (e.g. a spawn failure)
                self.log.emit("supervisor.error", error=repr(exc))
                time.sleep(0.5)

    def _check_shadow(self) -> None:
        cause = self._check_shadow_locked()
        if cause is not None:  # outside the lock: a restart takes seconds
            self._recover_memory(cause)

    def _check_shadow_locked(self) -> str | None:
        """Follow the shadow's state; a cause to restart the slot from scratch, if there is one."""
        with self._lock:
            shadow = self.shadow
            if shadow is None or self._stopping.is_set():
                return None
            state = (shadow.state() or {}).get("state")
            raised_at = (self.flag.read() or {}).get("time") if state == "standby" else None
            if (
                state == "standby"
                and raised_at is None
                and self._stale(Heartbeat(self.shadow_alive), shadow.pid, "shadow")
            ):
                # A hung standby shadow (SIGSTOP, a stuck event loop) would leave the slot
                # unprotected until the main fails: replace it now.
                age = Heartbeat(self.shadow_alive).age_s()
                self.log.emit("shadow.hung", pid=shadow.pid, age_s=None if age is None else round(age, 3))
                shadow.kill()
                self.shadow = self._spawn("shadow")
                return None
            if isinstance(raised_at, float) and time.time() - raised_at > self.config.handover_timeout_s:
                # The flag is up and the shadow has not moved (it is hung, e.g. SIGSTOPped): no
                # handover will come; the slot restarts from scratch instead.
                self.log.emit("shadow.stuck", pid=shadow.pid, waited_s=round(time.time() - raised_at, 3))
                # `_recover_memory` SIGKILLs it first (it is still `self.shadow`).
                return "the shadow did not take over within handover_timeout_s"
            if state == "handover" and shadow.generation != self._handover_generation:
                self._handover_generation = shadow.generation
                if self.second_failure():
                    return None
                self.last_handover = time.monotonic()
            elif state == "serving":
                self._promote(shadow)
            elif state == "failed" or not shadow.alive():
                self.log.emit("shadow.lost", pid=shadow.pid, state=state, exit_code=shadow.exit_code)
                if state == "memory_lost":  # its handover found a memory server gone or silent
                    self.shadow = None
                    return "the shadow's handover found a memory server gone"
                if state == "failed":
                    # The shadow found the memory or the device bad and marked the slot unhealthy;
                    # marking it again here covers a shadow that could not reach the router.
                    self.shadow = None
                    self.healthy = False
                    threading.Thread(target=self.mark_unhealthy, daemon=True).start()
                elif state is None and self._num_failed_starts >= _MAX_FAILED_STARTS:
                    self.shadow = None  # it never came up: do not crash-loop; its log says why
                    self.log.emit("shadow.gave_up", log_file=str(shadow.log_file))
                else:
                    self._num_failed_starts = self._num_failed_starts + 1 if state is None else 0
                    self.shadow = self._spawn("shadow")
        return None

    def _promote(self, shadow: Child) -> None:
        residual = self.main
        if residual is not None and residual.alive():
            residual.kill()
            self.log.emit("residual.killed", pid=residual.pid)
        if self.last_handover is None or self._handover_generation != shadow.generation:
            self.last_handover = time.monotonic()
        self.main = shadow
        self.num_handovers += 1
        self.flag.clear()
        self.log.emit("handover.complete", pid=shadow.pid, epoch=(shadow.state() or {}).get("epoch"))
        self.shadow = self._spawn("shadow")
