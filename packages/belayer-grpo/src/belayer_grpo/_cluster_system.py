"""`ClusterSystem`: the rollout system on Ray (belayer-cluster), chosen by `cluster.nodes` / `cluster.address`.

The same face as `RolloutSystem` (router URL, slots that can be killed, weight sockets, events,
healthy slots, a router client), with the slots placed one per Ray bundle and the router a process
of this driver, its journal on the shared directory. `cluster.nodes = N` starts a local Ray
cluster of N simulated nodes on this machine; `cluster.address` joins an existing one.
`chaos.kill_node_at_step = K` removes the node of the last healthy slot mid-rollout of step K:
its requests resume token-exact on the slots left (no replacement is started: training continues
on what is left and says so), and the run report says what happened. Every weight update goes
through belayer-cluster's `WeightSync` (one agent per node, its own gloo group, a checksum per
node): `ClusterWeights.push` drops a lost node from the sync, and the metrics and the report carry
the weight version and checksum of every node. An agentic workload (tooluse, swe) gets one
belayer-cluster sandbox host per node: `open_pool` gives the run a `ClusterSandboxPool` whose
sandboxes live on the nodes' hosts, checkpoints in the shared directory; a lost node's sandboxes
are restored on another node from their latest ready checkpoint, tied to the same LLM prefix, and
the report counts them. belayer-cluster is imported
only when the cluster is asked for, and only it imports ray: the default run never starts Ray.
"""

from __future__ import annotations

import contextlib
import math
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs
import httpx

from belayer_grpo._config import Config
from belayer_grpo._errors import BelayerGrpoError, SystemStartError
from belayer_grpo._system import RolloutSystem
from belayer_router import RouterClient

if TYPE_CHECKING:
    import torch

    from belayer_cluster import (
        DriverRouter,
        LocalRayCluster,
        NodeLoss,
        RolloutCluster,
        SandboxCluster,
        WeightSync,
    )
    from belayer_grpo._agentic.pool import SandboxPool
    from belayer_shadow import ModelConfig

__all__ = ["ClusterSystem", "ClusterWeights", "cluster_wanted", "rollout_system"]

KILL_AFTER_TOKENS = 24  # the node is removed once this many tokens of the step have streamed
# ... and, with sandboxes, once one of its sandboxes has a ready checkpoint (or after this long)
KILL_WAIT_CHECKPOINT_S = 300.0
KILL_HOLD_S = 300.0  # the held trajectory goes on after this long even if the loss is not handled
SYNC_TIMEOUT_S = 120.0  # every rendezvous and transfer of the weight sync (a loaded machine)


def cluster_wanted(config: Config) -> bool:
    """True when the run asks for Ray (`cluster.nodes > 0` or `cluster.address`)."""
    return config.cluster.nodes > 0 or bool(config.cluster.address)


def rollout_system(
    config: Config, run_dir: Path, model_config: ModelConfig, weights_file: Path
) -> AbstractAsyncContextManager[RolloutSystem | ClusterSystem]:
    """`ClusterSystem.start` when the run asks for Ray, else the single-machine `RolloutSystem.start`."""
    if cluster_wanted(config):
        return ClusterSystem.start(config, run_dir, model_config, weights_file)
    return RolloutSystem.start(config, run_dir, model_config, weights_file)


class LiveSockets(Sequence[Path]):
    """The weight sockets of the slots in service, read when a push iterates them.

    A push first waits for a node removal under way (`chaos.kill_node_at_step`) to be handled, so
    it never writes to a lost node's weight server; a lost node's sockets leave the list.
    """

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self.pending: threading.Thread | None = None

    def _settle(self) -> list[Path]:
        if self.pending is not None:
            self.pending.join(timeout=240)
        return list(self.paths)

    def __iter__(self) -> Iterator[Path]:
        return iter(self._settle())

    def __len__(self) -> int:
        return len(self._settle())

    def __getitem__(self, index: Any) -> Any:
        return self._settle()[index]


class ClusterWeights:
    """The trainer's weight pushes on Ray: every update through belayer-cluster's `WeightSync`.

    The same face as the single-machine `WeightSync.push` (returns the weight servers' versions),
    plus `metrics()` and `status()`: the sync's version and checksum and every node's. A push first
    waits for a node removal under way to be handled, then drops the lost nodes from the sync; a
    node that dies or hangs during the update is dropped by the update itself (the update ends with
    the router requiring the new version, so that node's slots are held out until current again).
    """

    def __init__(self, sync: WeightSync, rollout: RolloutCluster, sockets: LiveSockets) -> None:
        self.sync, self.rollout, self.sockets = sync, rollout, sockets
        self.versions: list[int] = []
        self.after_push: Callable[[], None] | None = None  # cluster.replace_lost_nodes
        self.num_pushes = 0
        self.seconds = 0.0

    def push(self, model: torch.nn.Module) -> list[int]:
        """Send `model`'s parameters to every live node (blocking; call from a thread)."""
        from belayer_cluster import BelayerClusterError

        start = time.monotonic()
        self.sockets._settle()  # a node removal under way is handled first
        for node_id in {loss.node_id for loss in self.rollout.losses} & set(self.sync.members):
            self.sync.drop_node(node_id, "its node was lost (Ray)")
        tensors = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        try:
            result = self.sync.update(tensors)
        except BelayerClusterError as error:
            raise BelayerGrpoError(f"the weight update reached no node: {error}") from error
        self.versions = [version for report in result.nodes for version in report.server_versions]
        if self.after_push is not None:  # a replacement joins with this version, before the next rollout
            self.after_push()
        self.num_pushes += 1
        self.seconds += time.monotonic() - start
        return self.versions

    def metrics(self) -> dict[str, Any]:
        """A metrics line's weight fields: the version and checksum, and each live node's."""
        status = self.sync.status()
        return {
            "weights_version": status["version"],
            "weights_checksum": status["checksum"],
            "weights_nodes": {
                node["node_id"][:12]: {"version": node["version"], "checksum": node["checksum"]}
                for node in status["nodes"]
            },
            "weights_nodes_dropped": len(status["dropped"]),
            "weights_update_s": status["last_update_s"],
        }

    def status(self) -> dict[str, Any]:
        """The run report's `weights`: belayer-cluster's `WeightSync.status()`."""
        return self.sync.status()


@attrs.frozen
class _SlotName:
    slot: str


@attrs.define
class RemoteSlot:
    """A slot on a Ray node, as `WorkerChaos` sees a slot: its name and `kill_main`."""

    config: _SlotName
    rollout: RolloutCluster

    def kill_main(self) -> float:
        """SIGKILL the slot's main worker (its shadow on the same node takes over)."""
        return self.rollout.kill_main(self.config.slot)


@attrs.define
class ClusterSystem:
    """The running router and slots of one training run, on Ray."""

    router_url: str
    admin_token: str
    slots: list[RemoteSlot]
    run_dir: Path
    rollout: RolloutCluster
    router: DriverRouter
    local: LocalRayCluster | None
    kill_node_at_step: int
    weight_sockets: LiveSockets  # a lost node's sockets leave it, so pushes skip them
    weights: ClusterWeights  # every push through belayer-cluster's WeightSync
    shared_dir: Path
    slot_options: dict[str, Any]
    replace_lost_nodes: bool
    replacements: list[RolloutCluster]  # the replacement slots' clusters (stopped with the rest)
    sandboxes: SandboxCluster | None = None  # agentic workloads: one sandbox host per node
    _losses: list[dict[str, Any]] = attrs.field(factory=list)
    _events: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict)
    _killer: threading.Thread | None = None
    _hold: _NodeLossHold | None = None

    @classmethod
    @asynccontextmanager
    async def start(
        cls, config: Config, run_dir: Path, model_config: ModelConfig, weights_file: Path
    ) -> AsyncIterator[ClusterSystem]:
        """Start (or join) Ray, the router and `system.num_slots` slots; stop them all at exit."""
        import json

        from belayer_cluster import BelayerClusterError

        model_file = run_dir / "model.json"
        model_file.write_text(json.dumps(model_config.to_dict(), indent=2))
        # Unix socket paths are short (107 bytes): the shared folder is short too.
        own_shared = not config.cluster.shared_dir
        shared = Path(config.cluster.shared_dir or tempfile.mkdtemp(prefix="belayer-grpo-cluster-"))
        parts = _Parts()
        try:
            _start_ray(config, parts)  # Ray sets signal handlers: only from the main thread
            system = await anyio.to_thread.run_sync(
                _start_sync, config, run_dir, shared, model_file, weights_file, parts
            )
        except BaseException as exc:
            _stop_all(parts)
            if own_shared:
                shutil.rmtree(shared, ignore_errors=True)
            if isinstance(exc, BelayerClusterError):
                raise SystemStartError(f"the cluster did not start: {exc}") from exc
            raise
        try:
            yield system
        finally:
            _stop_all(parts)  # blocking on purpose: Ray is stopped from the main thread
            if own_shared:
                shutil.rmtree(shared, ignore_errors=True)

    def client(self, timeout_s: float = 600.0, multiplex: bool = True) -> RouterClient:
        """A router client for rollouts (use as ``async with``).  ``multiplex`` (default): every
        concurrent generation travels on one client link (belayer-router's ``POST /client-link``),
        so the router writes one frame per turn for all of them, not one write per token each."""
        return RouterClient(self.router_url, self.admin_token, timeout_s=timeout_s, multiplex=multiplex)

    def events(self) -> list[dict[str, Any]]:
        """Every reachable slot's events (a lost slot's as last seen), tagged with the slot."""
        from belayer_cluster import SlotHostError

        lost = {slot for rollout in self._rollouts() for loss in rollout.losses for slot in loss.slots}
        for remote in self.slots:
            name = remote.config.slot
            if name in lost:
                continue
            with contextlib.suppress(SlotHostError):
                self._events[name] = [{**event, "slot": name} for event in remote.rollout.slot_events(name)]
        merged = [event for events in self._events.values() for event in events]
        return sorted(merged, key=lambda event: float(event.get("time", 0.0)))

    def num_handovers(self) -> int:
        """Completed handovers seen in the slots' events."""
        return sum(1 for event in self.events() if event.get("event") == "handover.complete")

    def healthy_slots(self) -> list[int]:
        """Indices of slots still in service (a lost node's are not)."""
        healthy = {slot for rollout in self._rollouts() for slot in rollout.healthy_slots}
        return [index for index, remote in enumerate(self.slots) if remote.config.slot in healthy]

    def replace_lost(self) -> None:
        """`cluster.replace_lost_nodes`: for each lost node, a new simulated node and a slot on it
        (`<slot>-r`) that joins the weight sync with the current version and only then serves.

        Called by the weight push after the update (the trainer's thread, between rollouts). A
        replacement that fails to start is reported in the node loss; training goes on without it.
        """
        from belayer_cluster import BelayerClusterError, start_replacement_slot

        if not self.replace_lost_nodes or self.local is None:
            return
        for loss in self._losses:
            if "replaced_by" in loss or "replacement_error" in loss:
                continue
            for slot in loss["slots"]:
                name, started = f"{slot}-r", time.monotonic()
                resource = {f"belayer-replacement-{name}": 1.0}  # only the new node offers it
                try:
                    node_id = self._add_node(self.local, resource)
                    cluster = start_replacement_slot(
                        self.weights.sync,
                        node_id,
                        name,
                        router_url=self.router_url,
                        shared_dir=self.shared_dir,
                        admin_token=self.admin_token,
                        slot_options=self.slot_options,
                        resources=resource,
                    )
                except BelayerClusterError as error:
                    loss["replacement_error"] = str(error)
                    continue
                self.replacements.append(cluster)
                self.slots.append(RemoteSlot(_SlotName(name), cluster))
                loss["replaced_by"] = {
                    "slot": name,
                    "node_id": node_id,
                    "weights_version": self.weights.sync.members[node_id].version,
                    "weights_checksum": self.weights.sync.members[node_id].checksum,
                    "start_s": time.monotonic() - started,
                }

    @staticmethod
    def _add_node(local: LocalRayCluster, resource: dict[str, float]) -> str:
        """A new simulated node, one CPU more than the slot takes (Ray reschedules the lost node's
        placement-group bundle onto a free CPU). Ray starts a node only from the main thread (signal
        handlers): from the push's worker thread, through the event loop's thread."""
        cpus = local.config.cpus_per_node + 1
        if threading.current_thread() is threading.main_thread():
            return local.add_node(num_cpus=cpus, resources=resource)
        return anyio.from_thread.run_sync(lambda: local.add_node(num_cpus=cpus, resources=resource))

    def open_pool(self, config: Config, run_dir: Path) -> SandboxPool:
        """The run's sandbox pool on the nodes' sandbox hosts (checkpoints in the shared directory)."""
        from belayer_envckpt import CheckpointStore
        from belayer_grpo._agentic.cluster_pool import ClusterSandboxPool
        from belayer_grpo._guardian import RUN_LABEL, run_marker
        from belayer_grpo._swe import connect_checkpoint_engine

        if self.sandboxes is None:
            raise SystemStartError("this cluster run has no sandbox hosts (a math workload)")
        return ClusterSandboxPool(
            connect_checkpoint_engine(), CheckpointStore(self.sandboxes.store_dir), capacity=config.rollout.max_sandboxes,
            labels={RUN_LABEL: run_marker(run_dir)}, reuse=config.data.workload == "tooluse",
            hosts=self.sandboxes, checkpointed=self._checkpointed,
        )  # fmt: skip

    def _checkpointed(self, node_id: str) -> None:
        """`chaos.kill_node_at_step`: the first trajectory whose sandbox on the victim node has a
        ready checkpoint waits here (its checkpointing thread, before its next action) until the
        node is removed and the loss handled, so the node goes with that sandbox still in use and
        its recovery restores it elsewhere (without the hold the trajectory could finish first)."""
        hold = self._hold
        if hold is not None and hold.claim(node_id):
            hold.released.wait(KILL_HOLD_S)

    def _rollouts(self) -> list[RolloutCluster]:
        return [self.rollout, *self.replacements]

    def before_rollout(self, step: int, num_trajectories: int = 0) -> None:
        """Arm `chaos.kill_node_at_step`: the node goes once the step's rollout is under way.

        ``num_trajectories`` is the step's count (an agentic step reports each one's end through
        `trajectory_finished`); `after_rollout` must follow, whatever the rollout's outcome.
        """
        if step != self.kill_node_at_step or self._killer is not None:
            return
        if self.local is None:
            raise SystemStartError("chaos.kill_node_at_step needs cluster.nodes (a local cluster)")
        victim_slot = self.slots[-1].config.slot
        victim = self.rollout.infos[victim_slot].node_id
        # With sandboxes, the node goes once a sandbox on it has a ready checkpoint (`_checkpointed`),
        # or once that can no longer be waited for (`_NodeLossHold.checkpoint_or_late`).
        self._hold = hold = _NodeLossHold(
            victim, num_trajectories, wants_checkpoint=self.sandboxes is not None
        )
        self._killer = threading.Thread(target=self._kill_node, args=(step, victim_slot, hold), daemon=True)
        self.weight_sockets.pending = self._killer
        self._killer.start()

    def trajectory_finished(self) -> None:
        """One trajectory of the step's rollout finished (its sandbox is no longer in use)."""
        if self._hold is not None:
            self._hold.trajectory_finished()

    def after_rollout(self, step: int) -> None:
        """The step's rollout is over: a node loss armed for it waits for nothing more of it (a
        checkpoint that never came, tokens that never streamed) and goes now, before the push."""
        if self._hold is not None and step == self.kill_node_at_step:
            self._hold.rollout_over()

    def node_losses(self) -> list[dict[str, Any]]:
        """What each lost node cost: requests resumed elsewhere, sandboxes restored, tokens lost, time."""
        if self._killer is not None:
            self._killer.join(timeout=180)
        metrics = _metrics(self.router_url)
        reports = []
        for loss in self._losses:
            resumed = metrics.get("resumes_total", 0.0) - loss["resumes_before"]
            failed = metrics.get("requests_failed_total", 0.0) - loss["failed_before"]
            # Restored by the node's recovery, or by their trajectory when it saw the loss first.
            restored = [] if self.sandboxes is None else self.sandboxes.restores
            moved = [r.to_dict() for r in restored if r.from_node == loss["node_id"]]
            # Each detector's first word on the node, seconds after its removal (the later one too).
            seen = self.rollout.detections.of(loss["node_id"])
            detections = {name: at - loss["removed_before"] for name, at in seen.items()}
            reports.append(
                {k: v for k, v in loss.items() if not k.endswith("_before")}
                | {"detections_s": detections}
                | {"requests_resumed": int(resumed), "tokens_lost": 0 if failed == 0 else None}
                | {"sandboxes_restored": len(moved), "sandboxes": moved}
            )
        return reports

    def _outstanding(self, slot: str) -> int:
        return _outstanding_of(self.router_url, self.admin_token, slot)

    def _kill_node(self, step: int, victim_slot: str, hold: _NodeLossHold) -> None:
        """Remove the victim's node once the step's rollout is under way. Every wait here ends at
        the rollout's end at the latest (`after_rollout`): never on an event that may not come."""
        try:
            start = _metrics(self.router_url).get("tokens_total", 0.0)
            while _metrics(self.router_url).get("tokens_total", 0.0) < start + KILL_AFTER_TOKENS:
                if hold.over.wait(0.02):
                    break
            if hold.wants_checkpoint:
                hold.checkpoint_or_late.wait(KILL_WAIT_CHECKPOINT_S)
            self._remove_node(step, victim_slot, hold.node_id)
        finally:
            hold.released.set()

    def _remove_node(self, step: int, victim_slot: str, victim: str) -> None:
        assert self.local is not None
        in_flight = self._outstanding(victim_slot)
        before = _metrics(self.router_url)
        removed, removed_wall = time.monotonic(), time.time()
        self.local.remove_node(victim)
        (loss,) = [
            x for x in self.rollout.wait_node_loss(len(self.rollout.losses) + 1, 180) if x.node_id == victim
        ]
        resumed_at = None
        wait_until = time.monotonic() + 30.0  # the router resumes a fenced slot's requests at once
        while in_flight and time.monotonic() < wait_until:  # streaming again: a request resumed
            if _metrics(self.router_url).get("resumes_total", 0.0) > before.get("resumes_total", 0.0):
                resumed_at = time.monotonic()
                break
            time.sleep(0.02)
        handled = loss.detected_at + loss.recover_s - removed_wall
        self._losses.append(
            {
                "node_id": victim,
                "step": step,
                "slots": list(loss.slots),
                "requests_in_flight": in_flight,
                "detected_by": loss.detected_by,
                "detect_s": loss.detected_at - removed_wall,
                "sandboxes_restored": len(loss.sandboxes),
                "slots_left": list(loss.slots_left),
                "time_to_recover_s": max(handled, (resumed_at or removed) - removed),
                "removed_before": removed_wall,
                "resumes_before": before.get("resumes_total", 0.0),
                "failed_before": before.get("requests_failed_total", 0.0),
            }
        )


@attrs.define
class _NodeLossHold:
    """When `chaos.kill_node_at_step` removes its node, and the trajectory held meanwhile.

    With sandboxes the node waits for a ready checkpoint of a sandbox on it: the first trajectory
    to take one claims the hold and waits for `released` (set once the node's loss is handled, or
    given up). The adaptive policy may take no checkpoint at all (the default tooluse workload
    often takes none), so `checkpoint_or_late` is also set once half the step's trajectories have
    finished (the node then goes mid-rollout with the sandboxes it has, restored from their
    latest ready checkpoint or from the image) and, at the latest, when the rollout is over.
    """

    node_id: str
    num_trajectories: int  # of the step; 0: not counted (only the rollout's end is late)
    wants_checkpoint: bool
    claimed: threading.Event = attrs.field(factory=threading.Event)
    checkpoint_or_late: threading.Event = attrs.field(factory=threading.Event)
    over: threading.Event = attrs.field(factory=threading.Event)  # the step's rollout is over
    released: threading.Event = attrs.field(factory=threading.Event)
    num_finished: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def claim(self, node_id: str) -> bool:
        with self._lock:
            if node_id != self.node_id or self.claimed.is_set() or self.released.is_set():
                return False
            self.claimed.set()
            self.checkpoint_or_late.set()
            return True

    def trajectory_finished(self) -> None:
        with self._lock:
            self.num_finished += 1
            if self.num_trajectories and 2 * self.num_finished >= self.num_trajectories:
                self.checkpoint_or_late.set()

    def rollout_over(self) -> None:
        with self._lock:
            self.over.set()
            self.checkpoint_or_late.set()


@attrs.define
class _Parts:
    """What has been started so far, stopped in reverse (also after a failed start)."""

    router: DriverRouter | None = None
    local: LocalRayCluster | None = None
    rollout: RolloutCluster | None = None
    sync: WeightSync | None = None
    sandboxes: SandboxCluster | None = None
    replacements: list[RolloutCluster] = attrs.field(factory=list)


def _outstanding_of(url: str, token: str, slot: str) -> int:
    try:
        answer = httpx.get(f"{url}/workers", headers={"Authorization": f"Bearer {token}"}, timeout=10.0)
        return sum(int(w["num_outstanding"]) for w in answer.json()["slots"] if w["slot"] == slot)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return 0


def _start_ray(config: Config, parts: _Parts) -> None:
    from belayer_cluster import LocalClusterConfig, LocalRayCluster, connect

    if config.cluster.address:
        connect(config.cluster.address)  # a ClusterStartError names the address
    else:
        per_node = max(1, math.ceil(config.system.num_slots / config.cluster.nodes))
        parts.local = LocalRayCluster(
            LocalClusterConfig(num_nodes=config.cluster.nodes, cpus_per_node=per_node)
        )
        parts.local.start()


def _start_sync(
    config: Config, run_dir: Path, shared: Path, model_file: Path, weights_file: Path, parts: _Parts
) -> ClusterSystem:
    from belayer_cluster import DriverRouter, RolloutCluster, SandboxCluster, WeightSync

    admin_token = secrets.token_hex(16)
    parts.router = router = DriverRouter(shared / "router.jsonl", admin_token=admin_token, resume_wait_s=30.0)
    router.start()
    names = [f"slot{index}" for index in range(config.system.num_slots)]
    sockets = LiveSockets()
    options = {
        "model": model_file,
        "weights": weights_file,
        "seed": config.model.seed,
        "recovery": config.system.recovery,
        "num_kv_blocks": config.system.kv_num_blocks,
        "block_size": config.system.kv_block_size,
        "max_num_seqs": min(config.rollout.concurrency, 256),
        "start_timeout_s": config.system.start_timeout_s,
        "stale_s": config.system.hang_threshold_s,
        "engine": config.system.engine,
    }

    def on_loss(loss: NodeLoss) -> None:
        for slot in loss.slots:
            gone = rollout.infos[slot].run_dir / "mem" / "weights.sock"
            if gone in sockets.paths:
                sockets.paths.remove(gone)

    if config.data.workload != "math":  # agentic: one sandbox host per node, checkpoints shared
        parts.sandboxes = SandboxCluster(shared, cluster_id=secrets.token_hex(6))
        parts.sandboxes.start()
    parts.rollout = rollout = RolloutCluster(
        names,
        router_url=router.url,
        shared_dir=shared,
        admin_token=admin_token,
        slot_options=options,
        start_timeout_s=config.system.start_timeout_s,
        on_node_loss=on_loss,
        sandboxes=parts.sandboxes,
    )
    infos = rollout.start()
    sockets.paths.extend(infos[name].run_dir / "mem" / "weights.sock" for name in names)
    parts.sync = sync = WeightSync(timeout_s=SYNC_TIMEOUT_S, router_url=router.url, admin_token=admin_token)
    by_node: dict[str, list[str]] = {}
    for name in names:
        by_node.setdefault(infos[name].node_id, []).append(name)
    for node_id, on_node in by_node.items():  # one agent per node, beside its slots' weight servers
        sync.add_node(
            node_id, sockets=[infos[name].run_dir / "mem" / "weights.sock" for name in on_node], slots=on_node
        )
    system = ClusterSystem(
        router_url=router.url,
        admin_token=admin_token,
        slots=[RemoteSlot(_SlotName(name), rollout) for name in names],
        run_dir=run_dir,
        rollout=rollout,
        router=router,
        local=parts.local,
        kill_node_at_step=config.chaos.kill_node_at_step,
        weight_sockets=sockets,
        weights=ClusterWeights(sync, rollout, sockets),
        shared_dir=shared,
        slot_options=options,
        replace_lost_nodes=config.cluster.replace_lost_nodes,
        replacements=parts.replacements,
        sandboxes=parts.sandboxes,
    )
    system.weights.after_push = system.replace_lost
    return system


def _stop_all(parts: _Parts) -> None:
    from belayer_cluster import BelayerClusterError, disconnect

    if parts.sync is not None:
        with contextlib.suppress(BelayerClusterError):
            parts.sync.close()
    if parts.sandboxes is not None:
        parts.sandboxes.stop()  # every sandbox left on any node
    for replacement in parts.replacements:
        replacement.stop()
    if parts.rollout is not None:
        parts.rollout.stop()
    if parts.router is not None:
        parts.router.stop()
    if parts.local is not None:
        parts.local.shutdown()
    disconnect()


_METRIC = re.compile(r"^belayer_router_(\w+)\s+([0-9.eE+-]+)$")


def _metrics(url: str) -> dict[str, float]:
    """The router's counters (`/metrics`), by name without the prefix; {} when it does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        match = _METRIC.match(line.strip())
        if match:
            found[match.group(1)] = float(match.group(2))
    return found
