"""The trainer's weight pushes on Ray: every update through belayer-cluster's `WeightSync`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from belayer_grpo._errors import BelayerGrpoError

if TYPE_CHECKING:
    import torch

    from belayer_cluster import RolloutCluster, WeightSync

__all__ = ["SYNC_TIMEOUT_S", "ClusterWeights", "LiveSockets"]

SYNC_TIMEOUT_S = 120.0  # every rendezvous and transfer of the weight sync (a loaded machine)


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
        return self.push_tensors({name: tensor.detach() for name, tensor in model.state_dict().items()})

    def push_tensors(self, tensors: dict[str, torch.Tensor]) -> list[int]:
        """`push` of a model's state dict (the rollout host's path: the trainer sends a file)."""
        from belayer_cluster import BelayerClusterError

        start = time.monotonic()
        self.sockets._settle()  # a node removal under way is handled first
        for node_id in {loss.node_id for loss in self.rollout.losses} & set(self.sync.members):
            self.sync.drop_node(node_id, "its node was lost (Ray)")
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
