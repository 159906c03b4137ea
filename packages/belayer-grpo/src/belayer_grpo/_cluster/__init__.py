"""The rollout system on Ray (belayer-cluster), chosen by `cluster.nodes` / `cluster.address`.

`ClusterSystem` has the same face as `RolloutSystem` (router URL, slots that can be killed, weight
pushes, events, healthy slots, a router client), with the slots placed one per Ray bundle and the
router a process of this driver, its journal on the shared directory. `cluster.nodes = N` starts a
local Ray cluster of N simulated nodes on this machine; `cluster.address` joins an existing one.
One module per role:

- `ray_start`: start (or join) Ray, the router, the sandbox hosts, the slots and the weight sync;
  stop them in reverse.
- `weights`: every weight update through belayer-cluster's `WeightSync` (one agent per node, its
  own gloo group, a checksum per node); a lost node is dropped from the sync.
- `node_chaos`: `chaos.kill_node_at_step = K` removes the node of the last healthy slot mid-rollout
  of step K: its requests resume token-exact on the slots left (no replacement: training continues
  on what is left and says so), its sandboxes are restored on another node from their latest ready
  checkpoint, and the run report says what the loss cost.
- `replacement`: `cluster.replace_lost_nodes`, a new simulated node and slot per lost slot.
- `sandbox_pool`: an agentic workload's `ClusterSandboxPool` on one sandbox host per node.
- `system`: `ClusterSystem`, which owns them.
- `hosted`: `HostedCluster`, the trainer's face of a `ClusterSystem` run by the rollout host
  (``system.resume_grace_s > 0``, every workload): the rollout side on Ray outlives a SIGKILLed
  trainer; `hosted_sandboxes`: its sandbox pool's calls, carried out by the host's sandbox hosts.

belayer-cluster is imported only when the cluster is asked for, and only it imports ray: the
default run never starts Ray.
"""

from __future__ import annotations

from belayer_grpo._cluster.hosted import HostedCluster, HostedWeights
from belayer_grpo._cluster.system import ClusterSystem, cluster_wanted, rollout_system
from belayer_grpo._cluster.weights import ClusterWeights

__all__ = [
    "ClusterSystem",
    "ClusterWeights",
    "HostedCluster",
    "HostedWeights",
    "cluster_wanted",
    "rollout_system",
]
