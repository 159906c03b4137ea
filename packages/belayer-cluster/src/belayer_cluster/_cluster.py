"""`RolloutCluster`: slots placed on Ray (one bundle each), node loss reported to the router."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from belayer_cluster._detect import Detections, RouterStreams
from belayer_cluster._errors import (
    ClusterConfigError,
    ClusterStartError,
    RouterAccessError,
    SandboxHostError,
    SlotHostError,
)
from belayer_cluster._sandboxes import SandboxCluster, SandboxRestore
from belayer_cluster._slot_host import SlotHost, SlotInfo
from belayer_router import RouterAdmin, RouterClientError

__all__ = ["NodeLoss", "RolloutCluster"]

_log = logging.getLogger(__name__)


@attrs.frozen
class NodeLoss:
    """A lost node: how it was seen, the slots fenced at the router, the sandboxes restored elsewhere.

    `detected_by` is the detector that named the node first: `"ray"` (Ray's node table said
    dead) or `"router broken streams"` (the router counted broken streams of one of its slots and
    that slot's host did not answer a ping);
    `detections` has the time (`time.time()`) each detector first named it, up to the handling
    (`RolloutCluster.detections` keeps counting after). `slots_left` are the slots still serving:
    no replacement is started, so with no spare capacity the rollout continues on them.
    `recover_s`: detection to every slot fenced and every sandbox restored.
    """

    node_id: str
    slots: tuple[str, ...]
    detected_by: str = "ray"
    sandboxes: tuple[SandboxRestore, ...] = ()
    slots_left: tuple[str, ...] = ()
    recover_s: float = 0.0
    detected_at: float = 0.0  # time.time() of the detection
    error: str = ""  # why a sandbox could not be restored, if one could not
    detections: dict[str, float] = attrs.field(factory=dict)  # detector -> first time it named the node

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**attrs.asdict(self, recurse=False), "sandboxes": [r.to_dict() for r in self.sandboxes]}


class RolloutCluster:
    """Rollout slots on a Ray cluster this process is connected to (`ray.init` / `LocalRayCluster`).

    One placement group holds one bundle per slot (`cpus_per_slot` CPUs), strategy SPREAD: slots
    go to different nodes while there are nodes; a slot's supervisor, memory servers, main and
    shadow are processes of its `SlotHost` actor and share its bundle, hence its node. The router
    is the caller's (the driver owns it, its journal on `shared_dir` or other storage that outlives
    any node); `start` registers nothing itself: each slot's main worker registers.

    A watcher thread polls Ray's node table every `poll_s`, and the router's per-slot broken
    streams (`_detect.RouterStreams`, `GET /workers`); a slot whose count rose and whose host
    actor does not answer a ping within `probe_timeout_s` has lost its node (a host that answers
    is on a live node: a handover; `live_breaks`). Whichever comes first (`detections` keeps when
    each detector named each node), the node's slots are marked unhealthy at the router, which
    resumes their requests on the other slots, and the node's sandboxes (`sandboxes`) are restored
    on another node. No replacement slot is started: the rollout continues on the slots left, and
    says so.
    """

    def __init__(
        self,
        slots: Sequence[str],
        *,
        router_url: str,
        shared_dir: Path,
        admin_token: str | None = None,
        cpus_per_slot: float = 1.0,
        resources: Mapping[str, float] | None = None,
        slot_options: Mapping[str, Any] | None = None,
        poll_s: float = 0.2,
        start_timeout_s: float = 180.0,
        probe_timeout_s: float = 3.0,
        sandboxes: SandboxCluster | None = None,
        on_node_loss: Callable[[NodeLoss], None] | None = None,
    ) -> None:
        if not slots or len(set(slots)) != len(slots):
            raise ClusterConfigError(f"slots must be distinct names, at least one (got {list(slots)!r})")
        if cpus_per_slot <= 0 or poll_s <= 0 or start_timeout_s <= 0 or probe_timeout_s <= 0:
            raise ClusterConfigError("cpus_per_slot, poll_s, start_timeout_s and probe_timeout_s must be > 0")
        self.slots = tuple(slots)
        self.router_url, self.admin_token = router_url.rstrip("/"), admin_token
        self.shared_dir = Path(shared_dir)
        self.cpus_per_slot, self.poll_s, self.start_timeout_s = cpus_per_slot, poll_s, start_timeout_s
        self.slot_options = dict(slot_options or {})
        self.resources = dict(resources or {})  # custom resources each bundle also takes (a given node's)
        self.probe_timeout_s, self.sandboxes = probe_timeout_s, sandboxes
        self.on_node_loss = on_node_loss  # called in the watcher thread before waiters hear of it
        self.infos: dict[str, SlotInfo] = {}
        self.hosts: dict[str, Any] = {}  # slot -> the SlotHost actor handle
        self.losses: list[NodeLoss] = []
        self._group: PlacementGroup | None = None
        self._bundles = {slot: index for index, slot in enumerate(self.slots)}  # slot -> its bundle
        self._stop = threading.Event()
        self._lost = threading.Condition()
        self._refused: str | None = None  # why the router refused a node loss (a 4xx), if it did
        self._watcher: threading.Thread | None = None
        self.detections = Detections()  # when Ray / the router first named each lost node
        # per slot, the router's broken-stream count the watcher last found explained by a live
        # host (its ping answered: a handover or a crashed worker on a live node, no node loss)
        self.live_breaks: dict[str, int] = {}
        self._streams = RouterStreams(self.router_url, admin_token)
        self.router_refused: str | None = None  # why the router refused GET /workers in a poll, if it did

    def start(self) -> dict[str, SlotInfo]:
        """Reserve the bundles, start every slot (concurrently) and the node watcher."""
        if not ray.is_initialized():
            raise ClusterStartError("connect to Ray first (ray.init(address=...) or LocalRayCluster)")
        self._streams.read()  # RouterAccessError now for a wrong admin token or URL (a router away is fine)
        bundles = [{"CPU": self.cpus_per_slot, **self.resources} for _ in self.slots]
        self._group = placement_group(bundles, strategy="SPREAD", name="")
        try:
            ray.get(self._group.ready(), timeout=self.start_timeout_s)
        except GetTimeoutError as exc:
            self.stop()
            raise ClusterStartError(
                f"{len(self.slots)} bundles of {self.cpus_per_slot} CPU could not be placed within "
                f"{self.start_timeout_s} s; add nodes or lower cpus_per_slot"
            ) from exc
        for index, slot in enumerate(self.slots):
            self.hosts[slot] = self._host(slot, index, self.slot_options)
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

    def replace(
        self,
        lost: str,
        slot: str,
        *,
        slot_options: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> SlotInfo:
        """Start slot `slot` in the placement-group bundle of `lost`, a slot of a lost node.

        Ray places a lost node's bundles again on live nodes with room, so the new slot lands on
        a live node and the watcher watches it like the others (its node lost: fenced, and it can
        be replaced in turn). `slot_options` replace this cluster's for it (weights kept since the
        start, say). Raises `ClusterStartError` when it does not serve within `timeout_s`
        (`start_timeout_s`): no room on the live nodes, or a slot that failed; it is then removed.
        """
        if self._group is None:
            raise ClusterStartError("start() the cluster before replacing a slot")
        if lost not in self._bundles or slot in self._bundles:
            raise ClusterConfigError(
                f"replace a slot of this cluster ({lost!r}) with a new name (got {slot!r})"
            )
        index = self._bundles[lost]
        options = self.slot_options if slot_options is None else dict(slot_options)
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        # The router's broken streams name a lost node before Ray does; until Ray has declared it
        # dead, the bundle stays there and a new actor in it would wait on a raylet that is gone.
        lost_node = self.infos[lost].node_id if lost in self.infos else ""
        while lost_node and _alive(lost_node):
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"replacement slot {slot!r} not started: Ray still counts node {lost_node[:12]} of "
                    f"slot {lost!r} alive after {timeout_s or self.start_timeout_s} s"
                )
            time.sleep(self.poll_s)
        host = self._host(slot, index, options)
        try:
            info: SlotInfo = ray.get(host.start.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except (RayError, SlotHostError) as exc:
            with contextlib.suppress(RayError):
                ray.get(host.stop.remote(), timeout=60)
            ray.kill(host)
            raise ClusterStartError(
                f"replacement slot {slot!r} did not start: {exc!r}; no live node may have room for it"
            ) from exc
        # New dicts, not changed ones: the watcher thread iterates over them meanwhile.
        self._bundles = {**self._bundles, slot: index}
        self.hosts = {**self.hosts, slot: host}
        self.infos = {**self.infos, slot: info}
        self.slots = (*self.slots, slot)
        return info

    def _host(self, slot: str, index: int, options: Mapping[str, Any]) -> Any:
        """A `SlotHost` actor for `slot` in bundle `index` (not started)."""
        if self._group is None:
            raise ClusterStartError("the cluster's placement group is gone (stopped)")
        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)
        return (
            ray.remote(SlotHost)
            .options(  # type: ignore[attr-defined]
                num_cpus=self.cpus_per_slot, max_concurrency=8, scheduling_strategy=strategy, max_restarts=0
            )
            .remote(slot, self.router_url, str(self.shared_dir), self.admin_token, dict(options))
        )

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

    def kill_main(self, slot: str, signum: int = 9) -> float:
        """Chaos: send `signum` (SIGKILL) to a slot's main worker; returns when it was sent (time.time)."""
        try:
            return float(ray.get(self.hosts[slot].kill_main.remote(signum), timeout=60))
        except (KeyError, RayError) as exc:
            raise SlotHostError(f"could not kill slot {slot!r}'s main worker: {exc}") from exc

    def slot_events(self, slot: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """A slot's event log, oldest first; `SlotHostError` when its host does not answer (lost node)."""
        try:
            events: list[dict[str, Any]] = ray.get(self.hosts[slot].events.remote(), timeout=timeout_s)
        except (KeyError, RayError) as exc:
            raise SlotHostError(f"slot {slot!r}'s host did not answer: {exc}") from exc
        return events

    @property
    def healthy_slots(self) -> tuple[str, ...]:
        """The slots not on a lost node (no replacement is started for a lost one)."""
        lost = {slot for loss in self.losses for slot in loss.slots}
        return tuple(slot for slot in self.slots if slot not in lost)

    def _watch(self) -> None:
        handled: set[str] = set()
        while not self._stop.wait(self.poll_s):
            now = time.time()
            try:
                nodes = ray.nodes()  # type: ignore[no-untyped-call]
                dead = {n["NodeID"] for n in nodes if not n["Alive"]}
            except RayError:
                dead = set()
            for node_id in dead:  # also once handled: a report can say which detector came first
                self.detections.saw(node_id, "ray", now)
            for node_id in self._broken_streams(handled | dead | self._suspected()):
                self.detections.saw(node_id, "router broken streams", time.time())
            for node_id in sorted(dead | self._suspected() - handled):
                if node_id not in handled and self._handle(node_id, self.detections.first(node_id)):
                    handled.add(node_id)

    def _suspected(self) -> set[str]:
        return {info.node_id for info in self.infos.values() if self.detections.of(info.node_id)}

    def _broken_streams(self, skip: set[str]) -> set[str]:
        """Nodes of slots whose broken-stream count rose at the router and whose host does not
        answer a ping within `probe_timeout_s`; a host that answers explains the breaks (a
        handover or a crashed worker on a live node): they are acknowledged, `live_breaks`."""
        suspects: set[str] = set()
        try:
            rises = self._streams.rises()
        except RouterAccessError as exc:  # refused after start (checked there): said once, Ray goes on
            if self.router_refused is None:
                _log.warning("router broken-stream detector off: %s", exc)
            self.router_refused = str(exc)
            return suspects
        for slot, streams in rises.items():
            info = self.infos.get(slot)
            if info is None or info.node_id in skip:  # not this cluster's slot, or its node is known
                self._streams.acknowledge(streams)
                continue
            if info.node_id in suspects:
                continue
            try:
                ray.get(self.hosts[slot].ping.remote(), timeout=self.probe_timeout_s)
            except (RayError, KeyError):
                suspects.add(info.node_id)  # not acknowledged: a later poll still sees the rise
            else:
                self._streams.acknowledge(streams)
                self.live_breaks[slot] = streams.num_stream_failures
        return suspects

    def _handle(self, node_id: str, detected_by: str) -> bool:
        """Fence the node's slots and restore its sandboxes; False to try again on the next poll."""
        began, detected_at = time.monotonic(), time.time()
        slots = tuple(s for s, info in self.infos.items() if info.node_id == node_id)
        has_sandboxes = self.sandboxes is not None and (
            any(info.node_id == node_id for info in list(self.sandboxes.placed.values()))
            or any(parked.node_id == node_id for parked in list(self.sandboxes.idle))
        )
        if not slots and not has_sandboxes:
            return True
        try:
            if slots:
                self._fence(slots)
        except RouterClientError as exc:
            self._warn(node_id, exc)
            if exc.status >= 500:  # the router is busy or restarting: retry
                return False
            # a 4xx (bad admin token, unknown slot) will not mend itself: waiters get the
            # reason instead of a timeout
            with self._lost:
                self._refused = (
                    f"the router refused to mark the slots {list(slots)} of lost node "
                    f"{node_id[:12]} unhealthy ({exc.status}): check the "
                    "admin token and the slot names"
                )
                self._lost.notify_all()
            return True
        except Exception as exc:  # router away (transport) or anything else: try again next poll
            self._warn(node_id, exc)
            return False
        restored: list[SandboxRestore] = []
        error = ""
        if self.sandboxes is not None:
            try:
                restored = self.sandboxes.recover_node(node_id)
            except Exception as exc:  # SandboxHostError, or anything else: the watcher must go on
                error = str(exc) if isinstance(exc, SandboxHostError) else repr(exc)
                print(f"belayer-cluster: sandboxes of lost node {node_id[:12]}: {exc}", file=sys.stderr)
        lost = {slot for loss in self.losses for slot in loss.slots} | set(slots)
        left = tuple(slot for slot in self.slots if slot not in lost)
        loss = NodeLoss(
            node_id,
            slots,
            detected_by,
            tuple(restored),
            left,
            time.monotonic() - began,
            detected_at,
            error,
            self.detections.of(node_id),
        )
        print(
            f"belayer-cluster: node {node_id[:12]} lost ({detected_by}): slots {list(slots)} fenced, "
            f"{len(restored)} sandboxes restored elsewhere; continuing on {len(left)} of {len(self.slots)} "
            "slots (no replacement started)",
            file=sys.stderr,
        )
        if self.on_node_loss is not None:
            try:
                self.on_node_loss(loss)
            except Exception as exc:  # the caller's hook must not end the watcher
                print(f"belayer-cluster: on_node_loss hook failed: {exc!r}", file=sys.stderr)
        self._record(loss)
        return True

    @staticmethod
    def _warn(node_id: str, exc: BaseException) -> None:
        print(f"belayer-cluster: router did not take node loss {node_id[:12]}: {exc}", file=sys.stderr)

    def _record(self, loss: NodeLoss) -> None:
        with self._lost:
            self.losses.append(loss)
            self._lost.notify_all()

    def _fence(self, slots: tuple[str, ...]) -> None:
        """Mark the slots unhealthy at the router (`RouterAdmin`); a slot it does not know is a
        refusal (`RouterClientError` 404: a wrong slot name will not mend itself)."""
        with RouterAdmin(self.router_url, self.admin_token) as admin:
            for slot in slots:
                if not admin.mark_unhealthy(slot):
                    raise RouterClientError(404, f"the router does not know slot {slot!r}")


def _alive(node_id: str) -> bool:
    """Whether Ray's node table counts the node alive (a node it no longer lists is not)."""
    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())  # type: ignore[no-untyped-call]
    except RayError:
        return True
