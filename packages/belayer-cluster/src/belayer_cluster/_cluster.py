"""`RolloutCluster`: slots placed on Ray (one bundle each), node loss reported to the router."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from belayer_cluster._errors import ClusterConfigError, ClusterStartError, SlotHostError
from belayer_cluster._slot_host import SlotHost, SlotInfo

__all__ = ["NodeLoss", "RolloutCluster"]


@attrs.frozen
class NodeLoss:
    """A node Ray declared dead and the slots that were on it (marked unhealthy at the router)."""

    node_id: str
    slots: tuple[str, ...]


class RolloutCluster:
    """Rollout slots on a Ray cluster this process is connected to (`ray.init` / `LocalRayCluster`).

    One placement group holds one bundle per slot (`cpus_per_slot` CPUs), strategy SPREAD: slots
    go to different nodes while there are nodes; a slot's supervisor, memory servers, main and
    shadow are processes of its `SlotHost` actor and share its bundle, hence its node. The router
    is the caller's (the driver owns it, its journal on `shared_dir` or other storage that outlives
    any node); `start` registers nothing itself: each slot's main worker registers.

    A watcher thread polls Ray's node table every `poll_s`; when a node with slots dies, those
    slots are marked unhealthy at the router, which resumes their requests on the other slots.
    """

    def __init__(
        self,
        slots: Sequence[str],
        *,
        router_url: str,
        shared_dir: Path,
        admin_token: str | None = None,
        cpus_per_slot: float = 1.0,
        slot_options: Mapping[str, Any] | None = None,
        poll_s: float = 0.2,
        start_timeout_s: float = 180.0,
    ) -> None:
        if not slots or len(set(slots)) != len(slots):
            raise ClusterConfigError(f"slots must be distinct names, at least one (got {list(slots)!r})")
        if cpus_per_slot <= 0 or poll_s <= 0 or start_timeout_s <= 0:
            raise ClusterConfigError("cpus_per_slot, poll_s and start_timeout_s must be > 0")
        self.slots = tuple(slots)
        self.router_url, self.admin_token = router_url.rstrip("/"), admin_token
        self.shared_dir = Path(shared_dir)
        self.cpus_per_slot, self.poll_s, self.start_timeout_s = cpus_per_slot, poll_s, start_timeout_s
        self.slot_options = dict(slot_options or {})
        self.infos: dict[str, SlotInfo] = {}
        self.hosts: dict[str, Any] = {}  # slot -> the SlotHost actor handle
        self.losses: list[NodeLoss] = []
        self._group: PlacementGroup | None = None
        self._stop = threading.Event()
        self._lost = threading.Condition()
        self._refused: str | None = None  # why the router refused a node loss (a 4xx), if it did
        self._watcher: threading.Thread | None = None

    def start(self) -> dict[str, SlotInfo]:
        """Reserve the bundles, start every slot (concurrently) and the node watcher."""
        if not ray.is_initialized():
            raise ClusterStartError("connect to Ray first (ray.init(address=...) or LocalRayCluster)")
        bundles = [{"CPU": self.cpus_per_slot} for _ in self.slots]
        self._group = placement_group(bundles, strategy="SPREAD", name="")
        try:
            ray.get(self._group.ready(), timeout=self.start_timeout_s)
        except GetTimeoutError as exc:
            self.stop()
            raise ClusterStartError(
                f"{len(self.slots)} bundles of {self.cpus_per_slot} CPU could not be placed within "
                f"{self.start_timeout_s} s; add nodes or lower cpus_per_slot"
            ) from exc
        actor = ray.remote(SlotHost)
        for index, slot in enumerate(self.slots):
            strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)
            self.hosts[slot] = actor.options(  # type: ignore[attr-defined]
                num_cpus=self.cpus_per_slot, max_concurrency=8, scheduling_strategy=strategy, max_restarts=0
            ).remote(slot, self.router_url, str(self.shared_dir), self.admin_token, self.slot_options)
        pending = {slot: host.start.remote() for slot, host in self.hosts.items()}
        try:
            for slot, ref in pending.items():
                self.infos[slot] = ray.get(ref, timeout=self.start_timeout_s)
        except (RayError, SlotHostError) as exc:
            self.stop()
            raise ClusterStartError(f"a slot did not start: {exc}") from exc
        self._watcher = threading.Thread(target=self._watch, name="belayer-cluster-watcher", daemon=True)
        self._watcher.start()
        return dict(self.infos)

    def wait_node_loss(self, count: int = 1, timeout_s: float = 60.0) -> list[NodeLoss]:
        """Block until `count` node losses have been handled (slots marked unhealthy)."""
        with self._lost:
            seen = self._lost.wait_for(
                lambda: len(self.losses) >= count or self._refused is not None, timeout=timeout_s
            )
            if self._refused is not None:
                raise SlotHostError(self._refused)
            if not seen:
                raise SlotHostError(f"fewer than {count} node losses seen within {timeout_s} s")
            return list(self.losses)

    def stop(self) -> None:
        """Stop the watcher, every slot still reachable, and release the bundles."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
            self._watcher = None
        lost = {slot for loss in self.losses for slot in loss.slots}
        refs = [host.stop.remote() for slot, host in self.hosts.items() if slot not in lost]
        for ref in refs:
            with contextlib.suppress(RayError):  # its node is gone: the guardian cleaned up after it
                ray.get(ref, timeout=60)
        for host in self.hosts.values():
            ray.kill(host)
        self.hosts.clear()
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    def _watch(self) -> None:
        handled: set[str] = set()
        while not self._stop.wait(self.poll_s):
            try:
                nodes = ray.nodes()  # type: ignore[no-untyped-call]
                dead = {n["NodeID"] for n in nodes if not n["Alive"]}
            except RayError:
                continue
            for node_id in sorted(dead - handled):
                slots = tuple(s for s, info in self.infos.items() if info.node_id == node_id)
                try:
                    if slots:
                        self._report(NodeLoss(node_id, slots))
                except httpx.HTTPStatusError as exc:
                    if exc.response.status_code >= 500:  # the router is busy or restarting: retry
                        self._warn(node_id, exc)
                        continue
                    # a 4xx (bad admin token, unknown slot) will not mend itself: waiters get the
                    # reason instead of a timeout
                    self._warn(node_id, exc)
                    with self._lost:
                        self._refused = (
                            f"the router refused to mark the slots {list(slots)} of lost node "
                            f"{node_id[:12]} unhealthy ({exc.response.status_code}): check the "
                            "admin token and the slot names"
                        )
                        self._lost.notify_all()
                except httpx.TransportError as exc:  # the router is away for now: try again next poll
                    self._warn(node_id, exc)
                    continue
                except Exception as exc:  # never let the watcher die silently: node loss must be seen
                    self._warn(node_id, exc)
                    continue
                handled.add(node_id)

    @staticmethod
    def _warn(node_id: str, exc: BaseException) -> None:
        print(f"belayer-cluster: router did not take node loss {node_id[:12]}: {exc}", file=sys.stderr)

    def _record(self, loss: NodeLoss) -> None:
        with self._lost:
            self.losses.append(loss)
            self._lost.notify_all()

    def _report(self, loss: NodeLoss) -> None:
        headers = {} if self.admin_token is None else {"Authorization": f"Bearer {self.admin_token}"}
        with httpx.Client(timeout=30.0, headers=headers) as client:
            for slot in loss.slots:
                client.post(f"{self.router_url}/slots/{slot}/unhealthy").raise_for_status()
        self._record(loss)
