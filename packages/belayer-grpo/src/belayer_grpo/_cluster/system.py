"""`ClusterSystem`: the face the training loop sees of the rollout system on Ray.

It owns the parts (`ray_start`), the weight pushes (`weights`), the node-loss chaos
(`node_chaos`), the replacements (`replacement`) and the sandbox pool (`sandbox_pool`), and
answers the same calls as the single-machine `RolloutSystem`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from belayer_grpo._cluster.node_chaos import NodeLossChaos
from belayer_grpo._cluster.ray_start import Parts, start_ray, start_services, stop_all
from belayer_grpo._cluster.replacement import NodeReplacer
from belayer_grpo._cluster.sandbox_pool import open_cluster_pool
from belayer_grpo._cluster.weights import ClusterWeights, LiveSockets
from belayer_grpo._config import Config
from belayer_grpo._errors import SystemStartError
from belayer_grpo._rollout_host import HostSystem
from belayer_grpo._system import RolloutSystem
from belayer_router import RouterClient

if TYPE_CHECKING:
    from belayer_cluster import (
        DriverRouter,
        IsolatedRayCluster,
        LocalRayCluster,
        RolloutCluster,
        SandboxCluster,
    )
    from belayer_grpo._agentic.pool import SandboxPool
    from belayer_shadow import ModelConfig

__all__ = [
    "SHARED_PREFIX",
    "SHARED_RECORD",
    "ClusterSystem",
    "RemoteSlot",
    "cluster_wanted",
    "rollout_system",
]

SHARED_PREFIX = "belayer-grpo-cluster-"  # a run's own shared folder (temporary; short socket paths)
SHARED_RECORD = "cluster-shared"  # in the run folder: that folder's path, while it is in use


def cluster_wanted(config: Config) -> bool:
    """True when the run asks for Ray (`cluster.nodes > 0` or `cluster.address`)."""
    return config.cluster.nodes > 0 or bool(config.cluster.address)


def rollout_system(
    config: Config, run_dir: Path, model_config: ModelConfig, weights_file: Path
) -> AbstractAsyncContextManager[RolloutSystem | HostSystem | ClusterSystem]:
    """`ClusterSystem.start` when the run asks for Ray, else the single-machine `RolloutSystem.start`;
    with ``system.resume_grace_s > 0`` either in a rollout host process (`HostSystem.start`,
    `HostedCluster.start`: on Ray with the sandbox hosts of an agentic workload) that outlives the
    trainer for its grace."""
    if cluster_wanted(config):
        if config.system.resume_grace_s > 0:
            from belayer_grpo._cluster.hosted import HostedCluster

            return HostedCluster.start(config, run_dir, model_config, weights_file)
        return ClusterSystem.start(config, run_dir, model_config, weights_file)
    if config.system.resume_grace_s > 0:  # a rollout host that outlives the trainer for its grace
        return HostSystem.start(config, run_dir, model_config, weights_file)
    return RolloutSystem.start(config, run_dir, model_config, weights_file)


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
    local: LocalRayCluster | IsolatedRayCluster | None
    weight_sockets: LiveSockets  # a lost node's sockets leave it, so pushes skip them
    weights: ClusterWeights  # every push through belayer-cluster's WeightSync
    chaos: NodeLossChaos  # chaos.kill_node_at_step
    replacer: NodeReplacer | None  # cluster.replace_lost_nodes on a local cluster
    replacements: list[RolloutCluster]  # the replacement slots' clusters (stopped with the rest)
    sandboxes: SandboxCluster | None = None  # agentic workloads: one sandbox host per node
    _events: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict)

    @classmethod
    @asynccontextmanager
    async def start(
        cls, config: Config, run_dir: Path, model_config: ModelConfig, weights_file: Path
    ) -> AsyncIterator[ClusterSystem]:
        """Start (or join) Ray, the router and `system.num_slots` slots; stop them all at exit."""
        import json

        from belayer_cluster import BelayerClusterError

        (run_dir / "model.json").write_text(json.dumps(model_config.to_dict(), indent=2))
        # Unix socket paths are short (107 bytes): the shared folder is short too.
        own_shared = not config.cluster.shared_dir
        shared = Path(config.cluster.shared_dir or tempfile.mkdtemp(prefix=SHARED_PREFIX))
        if own_shared:  # a guardian removes it should this process die (`belayer_grpo._guardian`)
            (run_dir / SHARED_RECORD).write_text(str(shared))
        # What the slots read goes to the shared folder: a node does not see the trainer's run
        # folder (isolated nodes, real machines).
        inputs = shared / "inputs"
        inputs.mkdir(parents=True, exist_ok=True)
        model_file = inputs / "model.json"
        shutil.copyfile(run_dir / "model.json", model_file)
        weights_file = Path(shutil.copyfile(weights_file, inputs / weights_file.name))
        parts = Parts()
        try:
            start_ray(config, parts, shared)  # Ray sets signal handlers: only from the main thread
            await anyio.to_thread.run_sync(start_services, config, shared, model_file, weights_file, parts)
            system = _assemble(config, run_dir, shared, parts)
        except BaseException as exc:
            stop_all(parts)
            if own_shared:
                shutil.rmtree(shared, ignore_errors=True)
                (run_dir / SHARED_RECORD).unlink(missing_ok=True)
            if isinstance(exc, BelayerClusterError):
                raise SystemStartError(f"the cluster did not start: {exc}") from exc
            raise
        try:
            yield system
        finally:
            stop_all(parts)  # blocking on purpose: Ray is stopped from the main thread
            if own_shared:
                shutil.rmtree(shared, ignore_errors=True)
                (run_dir / SHARED_RECORD).unlink(missing_ok=True)

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
        (`<slot>-r`) that joins the weight sync with the current version and only then serves
        (`NodeReplacer`; called by the weight push after the update)."""
        if self.replacer is None:
            return
        for name, cluster in self.replacer.replace(self.chaos.losses):
            self.slots.append(RemoteSlot(_SlotName(name), cluster))

    def open_pool(self, config: Config, run_dir: Path) -> SandboxPool:
        """The run's sandbox pool on the nodes' sandbox hosts (checkpoints in the shared directory)."""
        if self.sandboxes is None:
            raise SystemStartError("this cluster run has no sandbox hosts (a math workload)")
        return open_cluster_pool(config, run_dir, self.sandboxes, self.chaos.checkpointed)

    def before_rollout(self, step: int, num_trajectories: int = 0) -> None:
        """Arm `chaos.kill_node_at_step`: the node of the last slot goes once the step's rollout is
        under way. ``num_trajectories`` is the step's count (an agentic step reports each one's end
        through `trajectory_finished`); `after_rollout` must follow, whatever the outcome."""
        self.chaos.before_rollout(step, self.slots[-1].config.slot, num_trajectories)

    def trajectory_finished(self) -> None:
        """One trajectory of the step's rollout finished (its sandbox is no longer in use)."""
        self.chaos.trajectory_finished()

    def after_rollout(self, step: int) -> None:
        """The step's rollout is over: a node loss armed for it waits for nothing more of it."""
        self.chaos.after_rollout(step)

    def node_losses(self) -> list[dict[str, Any]]:
        """What each lost node cost: requests resumed elsewhere, sandboxes restored, tokens lost, time."""
        return self.chaos.reports()

    def _rollouts(self) -> list[RolloutCluster]:
        return [self.rollout, *self.replacements]


def _assemble(config: Config, run_dir: Path, shared: Path, parts: Parts) -> ClusterSystem:
    """The `ClusterSystem` over started parts."""
    router, rollout, sync, sockets = parts.router, parts.rollout, parts.sync, parts.sockets
    if router is None or rollout is None or sync is None:
        raise SystemStartError("the cluster's router, slots and weight sync must be started first")
    chaos = NodeLossChaos(
        config.chaos.kill_node_at_step, router.url, parts.admin_token, rollout, parts.local,
        sockets, sandboxes=parts.sandboxes,
        partition_node_at_step=config.chaos.partition_node_at_step, partition_s=config.chaos.partition_s,
    )  # fmt: skip
    replacer = None
    if config.cluster.replace_lost_nodes and parts.local is not None:
        replacer = NodeReplacer(
            parts.local, sync, router.url, shared, parts.admin_token, parts.slot_options,
            parts.replacements,
        )  # fmt: skip
    system = ClusterSystem(
        router_url=router.url,
        admin_token=parts.admin_token,
        slots=[RemoteSlot(_SlotName(f"slot{index}"), rollout) for index in range(config.system.num_slots)],
        run_dir=run_dir,
        rollout=rollout,
        router=router,
        local=parts.local,
        weight_sockets=sockets,
        weights=ClusterWeights(sync, rollout, sockets),
        chaos=chaos,
        replacer=replacer,
        replacements=parts.replacements,
        sandboxes=parts.sandboxes,
    )
    system.weights.after_push = system.replace_lost
    return system
