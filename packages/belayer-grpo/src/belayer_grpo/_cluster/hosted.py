"""The rollout side on Ray in the rollout host: it outlives a SIGKILLed trainer for its grace period.

With ``cluster.nodes > 0`` (or ``cluster.address``) and ``system.resume_grace_s > 0`` the rollout
host (`belayer_grpo._rollout_host`) runs `ClusterSystem` itself, for every workload: it is the Ray
driver, so the cluster it started, the router, the slots, the weight sync and (agentic workloads)
the nodes' sandbox hosts with every sandbox belong to it, not to the trainer, and a SIGKILL of the
trainer ends none of them.  The trainer sees it as `HostedCluster`, which answers the calls of
`ClusterSystem` the training loop makes through the host's control socket:

- `HostedWeights.push`: the policy's state dict, written to ``rollout-host/push.pt`` (torch's
  format keeps every bit and tied tensors), loaded by the host and sent through belayer-cluster's
  `WeightSync` (`ClusterWeights.push_tensors`); the versions come back;
- the node chaos (``before_rollout``, ``trajectory_finished``, ``after_rollout``), the slots'
  events, the node-loss reports and the weight sync's metrics and status;
- `HostedCluster.open_pool`: the agentic sandbox pool, whose every sandbox call (create, action,
  probe, checkpoint, restore, remove, park, spares) goes to the host's `SandboxCluster`
  (`belayer_grpo._cluster.hosted_sandboxes`).  A resumed trainer's trajectories in flight restore
  their latest logged checkpoint (in the cluster's shared store) on a node's sandbox host, as on
  one machine (`belayer_grpo._agentic.journal`).

`answer_cluster` is the host's side of those calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from belayer_grpo._cluster.hosted_sandboxes import SANDBOX_OPS, HostedSandboxes, answer_sandboxes
from belayer_grpo._config import Config
from belayer_grpo._lease import host_dir
from belayer_grpo._rollout_host import HostSystem, _call

if TYPE_CHECKING:
    import torch

    from belayer_grpo._agentic.pool import SandboxPool
    from belayer_grpo._cluster.system import ClusterSystem

__all__ = ["CLUSTER_OPS", "HostedCluster", "HostedWeights", "answer_cluster"]

CLUSTER_OPS = frozenset(
    {"push_weights", "weights_metrics", "weights_status", "before_rollout", "trajectory_finished",
     "after_rollout", "node_losses", "events", "sandbox_store"}
) | SANDBOX_OPS  # fmt: skip
_PUSH_TIMEOUT_S = 600.0  # a push waits for a node removal under way and for every node's update


@attrs.define
class HostedWeights:
    """`ClusterWeights` of a rollout host, as the trainer pushes: the same `push`, `metrics`, `status`."""

    control: Path

    def push(self, model: torch.nn.Module) -> list[int]:
        """Send `model`'s parameters to every live node through the host (blocking; from a thread)."""
        import torch

        path = self.control.parent / "push.pt"
        aside = path.with_name(".push.pt.tmp")
        torch.save({name: tensor.detach() for name, tensor in model.state_dict().items()}, aside)
        os.replace(aside, path)
        request = {"op": "push_weights", "path": str(path)}
        return [int(version) for version in _call(self.control, request, timeout_s=_PUSH_TIMEOUT_S)]

    def metrics(self) -> dict[str, Any]:
        """A metrics line's weight fields (`ClusterWeights.metrics`)."""
        return dict(_call(self.control, {"op": "weights_metrics"}))

    def status(self) -> dict[str, Any]:
        """The run report's `weights` (`ClusterWeights.status`)."""
        return dict(_call(self.control, {"op": "weights_status"}))


@attrs.define
class HostedCluster(HostSystem):
    """The trainer's face of a rollout host that runs `ClusterSystem`: its calls, through the host."""

    num_released: int = 0  # sandboxes a killed trainer's trajectories held, removed by `open_pool`

    @property
    def _control(self) -> Path:
        return host_dir(self.run_dir) / "control.sock"

    @property
    def weights(self) -> HostedWeights:
        """The weight pushes, through the host's `ClusterWeights`."""
        return HostedWeights(self._control)

    def events(self) -> list[dict[str, Any]]:
        """Every reachable slot's events, tagged with the slot (`ClusterSystem.events`)."""
        return list(_call(self._control, {"op": "events"}))

    def before_rollout(self, step: int, num_trajectories: int = 0) -> None:
        """`ClusterSystem.before_rollout` (arms `chaos.kill_node_at_step`)."""
        request = {"op": "before_rollout", "step": step, "num_trajectories": num_trajectories}
        _call(self._control, request)

    def trajectory_finished(self) -> None:
        """`ClusterSystem.trajectory_finished`."""
        _call(self._control, {"op": "trajectory_finished"})

    def after_rollout(self, step: int) -> None:
        """`ClusterSystem.after_rollout`."""
        _call(self._control, {"op": "after_rollout", "step": step})

    def node_losses(self) -> list[dict[str, Any]]:
        """What each lost node cost (`ClusterSystem.node_losses`)."""
        return list(_call(self._control, {"op": "node_losses"}))

    def open_pool(self, config: Config, run_dir: Path) -> SandboxPool:
        """The run's sandbox pool on the host's sandbox hosts (`ClusterSystem.open_pool`, each call
        through the host); the sandboxes a killed trainer's trajectories held are removed first
        (`num_released`)."""
        from belayer_grpo._cluster.sandbox_pool import open_cluster_pool

        store = Path(_call(self._control, {"op": "sandbox_store"}))
        hosts = HostedSandboxes(self._control, store)
        self.num_released = hosts.open()
        return open_cluster_pool(config, run_dir, hosts, hosts.checkpointed)


async def answer_cluster(system: ClusterSystem, request: dict[str, Any]) -> Any:
    """The host's answer to one of `CLUSTER_OPS` (each blocking call in a thread)."""
    op = request["op"]
    if op in SANDBOX_OPS:
        return await answer_sandboxes(system, request)
    if op == "sandbox_store":
        if system.sandboxes is None:
            raise ValueError("this cluster run has no sandbox hosts (a math workload)")
        return str(system.sandboxes.store_dir)
    if op == "push_weights":
        import torch

        path = Path(request["path"])

        def load() -> dict[str, torch.Tensor]:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
            path.unlink(missing_ok=True)
            return dict(tensors)

        tensors = await anyio.to_thread.run_sync(load)
        return await anyio.to_thread.run_sync(system.weights.push_tensors, tensors)
    if op == "weights_metrics":
        return await anyio.to_thread.run_sync(system.weights.metrics)
    if op == "weights_status":
        return await anyio.to_thread.run_sync(system.weights.status)
    if op == "before_rollout":
        step, count = int(request["step"]), int(request.get("num_trajectories", 0))
        return await anyio.to_thread.run_sync(lambda: system.before_rollout(step, num_trajectories=count))
    if op == "trajectory_finished":
        return system.trajectory_finished()
    if op == "after_rollout":
        return await anyio.to_thread.run_sync(system.after_rollout, int(request["step"]))
    if op == "node_losses":
        return await anyio.to_thread.run_sync(system.node_losses)
    if op == "events":
        return await anyio.to_thread.run_sync(system.events)
    raise ValueError(f"unknown call {op!r}")
