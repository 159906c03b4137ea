"""`chaos.kill_node_at_step`: the node of the last slot removed mid-rollout, and what it cost.
`chaos.partition_node_at_step` (isolated nodes): that node cut off the network for
`chaos.partition_s` seconds instead, then its link restored.

Its requests resume token-exact on the slots left, its sandboxes are restored on another node
from their latest ready checkpoint, and `NodeLossChaos.reports` says, per lost node, the requests
resumed, the sandboxes restored, the tokens lost, each detector's first word and the time to
recover. Every wait here ends by the step's rollout's end at the latest: nothing waits on an
event that may not come.

A partitioned node that Ray declares dead while cut off is handled as a lost node (its slots
fenced at the router, which refuses them for good, its sandboxes restored elsewhere); when its link
comes back its raylet hears it was declared dead and the node ends, its containers with it. A
partition shorter than the detection is no loss: the node serves on, and the report says so
(`detected_by` "").
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import attrs

from belayer_grpo._cluster.weights import LiveSockets
from belayer_grpo._errors import SystemStartError
from belayer_router import RouterAdmin, RouterClientError, RouterCounters, RouterUnreachableError

if TYPE_CHECKING:
    from belayer_cluster import IsolatedRayCluster, LocalRayCluster, RolloutCluster, SandboxCluster

__all__ = ["KILL_AFTER_TOKENS", "NodeLossChaos", "NodeLossHold"]

KILL_AFTER_TOKENS = 24  # the node is removed once this many tokens of the step have streamed
# ... and, with sandboxes, once one of its sandboxes has a ready checkpoint (or it is too late)
KILL_WAIT_CHECKPOINT_S = 300.0
KILL_HOLD_S = 300.0  # the held trajectory goes on after this long even if the loss is not handled
# After a partition heals with no loss seen, the loss is waited for this much longer (a detection
# under way); a fenced node is waited for this long to end once its link is back.
PARTITION_GRACE_S = 30.0


@attrs.define
class NodeLossHold:
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
class NodeLossChaos:
    """Removes the node of the last healthy slot mid-rollout of step `kill_node_at_step` (0: never)."""

    kill_node_at_step: int
    router_url: str
    admin_token: str
    rollout: RolloutCluster
    local: LocalRayCluster | IsolatedRayCluster | None
    sockets: LiveSockets  # a push waits for the removal under way
    sandboxes: SandboxCluster | None = None
    partition_node_at_step: int = 0
    partition_s: float = 20.0
    losses: list[dict[str, Any]] = attrs.field(factory=list)  # a replacement adds `replaced_by`
    _killer: threading.Thread | None = None
    _hold: NodeLossHold | None = None

    def checkpointed(self, node_id: str) -> None:
        """Called after a sandbox on `node_id` has a ready checkpoint (its checkpointing thread,
        before the trajectory's next action). The first trajectory whose sandbox on the victim node
        has one waits here until the node is removed and the loss handled, so the node goes with
        that sandbox still in use and its recovery restores it elsewhere (without the hold the
        trajectory could finish first)."""
        hold = self._hold
        if hold is not None and hold.claim(node_id):
            hold.released.wait(KILL_HOLD_S)

    def before_rollout(self, step: int, victim_slot: str, num_trajectories: int = 0) -> None:
        """Arm the node loss for `step`: `victim_slot`'s node goes once the rollout is under way.
        `after_rollout` must follow, whatever the rollout's outcome."""
        if step not in (self.kill_node_at_step, self.partition_node_at_step) or self._killer is not None:
            return
        if self.local is None:
            raise SystemStartError("chaos.kill_node_at_step needs cluster.nodes (a local cluster)")
        victim = self.rollout.infos[victim_slot].node_id
        # With sandboxes, the node goes once a sandbox on it has a ready checkpoint (`checkpointed`),
        # or once that can no longer be waited for (`NodeLossHold.checkpoint_or_late`).
        self._hold = hold = NodeLossHold(
            victim, num_trajectories, wants_checkpoint=self.sandboxes is not None
        )
        self._killer = threading.Thread(target=self._kill_node, args=(step, victim_slot, hold), daemon=True)
        self.sockets.pending = self._killer
        self._killer.start()

    def trajectory_finished(self) -> None:
        """One trajectory of the step's rollout finished (its sandbox is no longer in use)."""
        if self._hold is not None:
            self._hold.trajectory_finished()

    def after_rollout(self, step: int) -> None:
        """The step's rollout is over: a node loss armed for it waits for nothing more of it (a
        checkpoint that never came, tokens that never streamed) and goes now, before the push."""
        if self._hold is not None and step in (self.kill_node_at_step, self.partition_node_at_step):
            self._hold.rollout_over()

    def reports(self) -> list[dict[str, Any]]:
        """What each lost node cost: requests resumed elsewhere, sandboxes restored, tokens lost, time."""
        if self._killer is not None:
            self._killer.join(timeout=180)
        with self._admin() as admin:
            now = _counters(admin)
        reports = []
        for loss in self.losses:
            resumed = now.resumes_total - loss["resumes_before"]
            failed = now.requests_failed_total - loss["failed_before"]
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

    def _admin(self) -> RouterAdmin:
        return RouterAdmin(self.router_url, self.admin_token, timeout_s=10.0)

    def _kill_node(self, step: int, victim_slot: str, hold: NodeLossHold) -> None:
        """Remove the victim's node once the step's rollout is under way. Every wait here ends at
        the rollout's end at the latest (`after_rollout`): never on an event that may not come."""
        try:
            with self._admin() as admin:
                start = _counters(admin).tokens_total
                while _counters(admin).tokens_total < start + KILL_AFTER_TOKENS:
                    if hold.over.wait(0.02):
                        break
                if hold.wants_checkpoint:
                    hold.checkpoint_or_late.wait(KILL_WAIT_CHECKPOINT_S)
                if step == self.partition_node_at_step:
                    self._partition_node(admin, step, victim_slot, hold.node_id)
                else:
                    self._remove_node(admin, step, victim_slot, hold.node_id)
        finally:
            hold.released.set()

    def _remove_node(self, admin: RouterAdmin, step: int, victim_slot: str, victim: str) -> None:
        assert self.local is not None
        in_flight = _outstanding(admin, victim_slot)
        before = _counters(admin)
        removed, removed_wall = time.monotonic(), time.time()
        self.local.remove_node(victim)  # an isolated node: killed whole (every process at once)
        (loss,) = [
            x for x in self.rollout.wait_node_loss(len(self.rollout.losses) + 1, 180) if x.node_id == victim
        ]
        resumed_at = None
        wait_until = time.monotonic() + 30.0  # the router resumes a fenced slot's requests at once
        while in_flight and time.monotonic() < wait_until:  # streaming again: a request resumed
            if _counters(admin).resumes_total > before.resumes_total:
                resumed_at = time.monotonic()
                break
            time.sleep(0.02)
        handled = loss.detected_at + loss.recover_s - removed_wall
        self.losses.append(
            {
                "node_id": victim,
                "step": step,
                "fault": "kill",
                "slots": list(loss.slots),
                "requests_in_flight": in_flight,
                "detected_by": loss.detected_by,
                "detect_s": loss.detected_at - removed_wall,
                "sandboxes_restored": len(loss.sandboxes),
                "slots_left": list(loss.slots_left),
                "time_to_recover_s": max(handled, (resumed_at or removed) - removed),
                "removed_before": removed_wall,
                "resumes_before": before.resumes_total,
                "failed_before": before.requests_failed_total,
            }
        )

    def _partition_node(self, admin: RouterAdmin, step: int, victim_slot: str, victim: str) -> None:
        """Cut the victim's link for `partition_s`, then restore it. A loss Ray or the router saw
        meanwhile is handled as a lost node's (and the node ends once back, its containers with it);
        none within the grace after the heal: the node served on."""
        from belayer_cluster import IsolatedRayCluster

        local = self.local
        if not isinstance(local, IsolatedRayCluster):
            raise SystemStartError(
                "chaos.partition_node_at_step needs cluster.isolated (nodes with a network)"
            )
        cut_node, heal_node = local.cut, local.heal
        in_flight = _outstanding(admin, victim_slot)
        before = _counters(admin)
        cut_at, cut_wall = time.monotonic(), time.time()
        cut_node(victim)
        healer = threading.Timer(self.partition_s, heal_node, args=(victim,))
        healer.daemon = True
        healer.start()
        deadline = cut_at + self.partition_s + PARTITION_GRACE_S
        loss = None
        while loss is None and time.monotonic() < deadline:
            loss = next((x for x in self.rollout.losses if x.node_id == victim), None)
            time.sleep(0.05)
        resumed_at = None
        if loss is not None:
            wait_until = time.monotonic() + 30.0
            while in_flight and time.monotonic() < wait_until:
                if _counters(admin).resumes_total > before.resumes_total:
                    resumed_at = time.monotonic()
                    break
                time.sleep(0.02)
        healer.join()
        ended = False
        if loss is not None:  # fenced: back on the network, it hears it was declared dead and ends
            end_by = time.monotonic() + PARTITION_GRACE_S
            while local.node_running(victim) and time.monotonic() < end_by:
                time.sleep(0.1)
            ended = not local.node_running(victim)
            local.forget(victim)  # ended, or killed now: counted as removed either way
        handled = (loss.detected_at + loss.recover_s - cut_wall) if loss is not None else 0.0
        self.losses.append(
            {
                "node_id": victim,
                "step": step,
                "fault": "partition",
                "partition_s": self.partition_s,
                "slots": list(loss.slots) if loss is not None else [],
                "requests_in_flight": in_flight,
                "detected_by": loss.detected_by if loss is not None else "",
                "detect_s": (loss.detected_at - cut_wall) if loss is not None else None,
                "sandboxes_restored": len(loss.sandboxes) if loss is not None else 0,
                "slots_left": list(loss.slots_left) if loss is not None else list(self.rollout.healthy_slots),
                "time_to_recover_s": max(handled, (resumed_at or cut_at) - cut_at)
                if loss is not None
                else 0.0,
                "node_ended_after_heal": ended,
                "removed_before": cut_wall,
                "resumes_before": before.resumes_total,
                "failed_before": before.requests_failed_total,
            }
        )


def _counters(admin: RouterAdmin) -> RouterCounters:
    """The router's counters; all 0 while it does not answer (the chaos goes on regardless)."""
    try:
        return admin.counters()
    except (RouterUnreachableError, RouterClientError):
        return RouterCounters()


def _outstanding(admin: RouterAdmin, slot: str) -> int:
    """The requests in flight on `slot`; 0 while the router does not answer."""
    try:
        state = admin.workers().slot(slot)
    except (RouterUnreachableError, RouterClientError):
        return 0
    return 0 if state is None else state.num_outstanding
