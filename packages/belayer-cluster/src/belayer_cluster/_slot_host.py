"""`SlotHost`: the Ray actor that runs one belayer-shadow `SlotSupervisor` on its node.

The actor process is the supervisor: it forks the memory servers, the main worker and the shadow,
so all of a slot's processes run on the actor's node. The memory servers are the supervisor's
children, not the main worker's: killing a main worker (or Ray killing an engine process with its
children) leaves the memory the shadow takes over from.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import attrs
import ray

from belayer_cluster._errors import SlotHostError

__all__ = ["SlotHost", "SlotInfo", "node_run_dir"]


def node_run_dir(shared_dir: Path, node_id: str, slot: str) -> Path:
    """Where a slot keeps its sockets and logs: named by node (`n-<first 12 hex digits>`).

    A shadow can only attach to sockets under its own node's folder, so one placed on the wrong
    node cannot pass a test by accident. Kept short: a Unix socket path has at most 107 bytes.
    """
    return shared_dir / "nodes" / f"n-{node_id[:12]}" / slot


@attrs.frozen
class SlotInfo:
    """Where a started slot runs: its node, the supervisor's pid, its folder and main worker."""

    slot: str
    node_id: str
    pid: int
    run_dir: Path
    main_url: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (paths as strings)."""
        return {**attrs.asdict(self), "run_dir": str(self.run_dir)}


class SlotHost:
    """One slot on one node; created by `RolloutCluster` in the slot's placement-group bundle."""

    def __init__(
        self, slot: str, router_url: str, shared_dir: str, admin_token: str | None, options: dict[str, Any]
    ) -> None:
        self.slot, self.router_url, self.admin_token = slot, router_url, admin_token
        self.shared_dir = Path(shared_dir)
        self.options = dict(options)
        # The main worker listens on the node's address: the router (on the driver's machine)
        # reaches it over the network, as it must when nodes share nothing (IsolatedRayCluster).
        self.options.setdefault("host", str(ray.util.get_node_ip_address()))  # type: ignore[no-untyped-call]
        self._supervisor: Any = None
        self._prepared: Any = None  # belayer-shadow PreparedWeights, between prepare and commit

    def start(self) -> SlotInfo:
        """Start the slot's processes and wait until its shadow stands by."""
        from belayer_shadow import BelayerShadowError, SlotConfig, SlotSupervisor

        node_id = ray.get_runtime_context().get_node_id()
        run_dir = node_run_dir(self.shared_dir, node_id, self.slot)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            config = SlotConfig(
                slot=self.slot,
                router_url=self.router_url,
                run_dir=run_dir,
                admin_token=self.admin_token,
                **self.options,
            )
            supervisor = SlotSupervisor(config)
            self._supervisor = supervisor
            supervisor.start()
            supervisor.wait_protected()
        except (BelayerShadowError, TypeError, ValueError) as exc:
            raise SlotHostError(f"slot {self.slot!r} on node {node_id[:12]} did not start: {exc}") from exc
        return SlotInfo(self.slot, node_id, os.getpid(), run_dir, str(supervisor.main_url))

    def ping(self) -> str:
        """This host's node id: an answer proves the actor (and its node) is alive."""
        return str(ray.get_runtime_context().get_node_id())

    def pids(self) -> dict[str, int]:
        """The live pids of the slot's processes, by role (main, shadow, weights, kv)."""
        supervisor = self._require()
        found: dict[str, int] = {}
        for role, child in (("main", supervisor.main), ("shadow", supervisor.shadow)):
            if child is not None and child.alive():
                found[role] = int(child.pid)
        for role, server in (("weights", supervisor.weights_server), ("kv", supervisor.kv_server)):
            if server is not None and server.alive():
                found[role] = int(server.pid)
        return found

    def kill_main(self, signum: int = int(signal.SIGKILL)) -> float:
        """Chaos: send `signum` to the main worker; returns the wall-clock time it was sent."""
        return float(self._require().kill_main(signum))

    def wait_handovers(self, count: int) -> int:
        """Block until `count` handovers have completed; returns the number so far."""
        supervisor = self._require()
        supervisor.wait_handovers(count)
        return int(supervisor.num_handovers)

    def events(self) -> list[dict[str, Any]]:
        """The slot's event log, oldest first."""
        return list(self._require().events())

    def prepare_weights(self, weight_dir: str) -> dict[str, Any]:
        """Read `weight_dir` (on storage this node reads), check it whole against the slot's weight
        server and write it into the server's inactive half (belayer-shadow's
        `SlotWeights.prepare`); nothing is served from it before `commit_weights`. Returns
        `{"error": why nothing was written, or "", "out": the slot is out (restarting or unhealthy:
        not written; the commit keeps the folder for its restart)}`."""
        from belayer_router import WeightLoadError
        from belayer_shadow import SlotWeights

        self.abort_weights()
        try:
            self._prepared = SlotWeights.for_slots([self._require()]).prepare(weight_dir)
        except (WeightLoadError, SlotHostError) as exc:
            return {"error": str(exc), "out": False}
        return {"error": "", "out": bool(self._prepared.out)}

    def commit_weights(self) -> dict[str, Any]:
        """Commit what `prepare_weights` wrote (or keep the folder for a slot that is out):
        `{"error": why it did not commit, or "", "tensors": how many, "skipped": kept for a restart}`."""
        from belayer_router import PartialWeightCommitError, WeightLoadError

        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return {"error": f"slot {self.slot!r}: no weights prepared", "tensors": 0, "skipped": False}
        try:
            tensors = int(prepared.commit())
        except (WeightLoadError, PartialWeightCommitError) as exc:
            return {"error": str(exc), "tensors": 0, "skipped": False}
        return {"error": "", "tensors": tensors, "skipped": bool(prepared.owner.skipped)}

    def abort_weights(self) -> None:
        """Abort what `prepare_weights` wrote: the weight server keeps serving what it served."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.abort()

    def stop(self) -> None:
        """Stop every process of the slot (nothing is left: belayer-shadow's guarantee)."""
        self.abort_weights()
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None

    def _require(self) -> Any:
        if self._supervisor is None:
            raise SlotHostError(f"slot {self.slot!r} is not started")
        return self._supervisor
