"""`WeightSync`: the trainer's side of weight updates to every node (issue 22).

Each node has one long-lived `WeightAgent` (a Ray actor beside the node's weight servers) and one
two-member gloo group with the trainer, formed through a fresh TCP rendezvous (a new `TCPStore`)
per group generation. An update sends the packed version over every node's group at once (one
thread per node), each agent commits it with its checksum, and the trainer checks every checksum
against its own. The groups are independent: a node lost mid-update breaks only its own group, so
the others finish without waiting for a timeout, and the lost node is dropped (its agent killed).
Before `update` returns, the router requires the new version (its weight-version gate: the
stale-version barrier): a dropped node's slots are held out until the node rejoins current.
A handover inside a node touches none of this: the agent and its group stay.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from belayer_cluster._errors import WeightSyncError, WeightSyncTimeoutError
from belayer_cluster._weightsync_agent import WeightAgent
from belayer_cluster._weightsync_link import (
    AfterChunk,
    NodeLink,
    WeightReport,
    WeightUpdateResult,
    call,
    connect,
    fence,
    report_versions,
    require_version,
    send_all,
)
from belayer_cluster._weightsync_pack import checksum, pack
from belayer_gpumem import WeightLayout

__all__ = ["WeightReport", "WeightSync", "WeightUpdateResult"]


class WeightSync:
    """Weight versions from this process (the trainer, rank 0) to a `WeightAgent` on every node.

    Call it from one thread, between rollouts: `add_node`, `update`, `attach`, `drop_node`.
    `timeout_s` bounds every rendezvous and every transfer (each collective carries it, and the
    trainer waits no longer for a node's commit); a node that does not answer is named and dropped.
    With `router_url`, the router's weight-version gate is the stale-version barrier: every slot
    of a node that committed version V is reported at V, and before `update` returns the router
    requires V, so no request is served by an old version after the step moved on. A slot that
    lags (its node dropped: hung, failed, dead) is held out of rotation, not fenced: when its node
    rejoins (`add_node` with the slot's weight server) and commits the current version it is
    reported and serves again. A slot attached with another version than the current one is
    fenced (marked unhealthy) for good.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        chunk_bytes: int = 64 << 20,
        host: str | None = None,
        router_url: str | None = None,
        admin_token: str | None = None,
        layout: WeightLayout | None = None,
    ) -> None:
        if timeout_s <= 0 or chunk_bytes <= 0:
            raise WeightSyncError("timeout_s and chunk_bytes must be > 0")
        self.timeout_s, self.chunk_bytes = timeout_s, chunk_bytes
        self.host = host
        self.router_url = None if router_url is None else router_url.rstrip("/")
        self.admin_token = admin_token
        self.version = 0  # 0: what the servers started with; every update adds one
        self.checksum = ""
        self.layout: WeightLayout | None = layout  # the servers' table; else the first node's
        self.members: dict[str, NodeLink] = {}
        self.dropped: dict[str, str] = {}  # node id -> why
        self.num_updates = 0
        self.last_update_s = 0.0
        self.last_join: dict[str, Any] = {}  # the last add_node's times: agent start, rendezvous, transfer
        self._flat: torch.Tensor | None = None  # the current version, kept for nodes that join later
        self._spare: torch.Tensor | None = None
        self._next_generation = 0
        self._lock = threading.Lock()

    # -- membership ---------------------------------------------------------------------------

    def add_node(
        self,
        node_id: str,
        *,
        sockets: Sequence[str | Path] = (),
        slots: Sequence[str] = (),
        serve_dir: str | Path | None = None,
    ) -> WeightReport:
        """Start the node's agent, attach it to `sockets` (the node's slots' weight servers), form
        its group through a fresh rendezvous and, if a version exists, send it in full.

        A node without slots yet gets a weight server of the agent's own in `serve_dir` (the table
        must be known: `layout=` or a node added with sockets first). When the node cannot join or
        does not commit the current version, its agent is removed again and WeightSyncError names
        the node and the members (WeightSyncTimeoutError, `.nodes`, when it did not answer within
        `timeout_s`: a hung node is an error, never a hang); the members are untouched.
        """
        with self._lock:
            if node_id in self.members:
                raise WeightSyncError(f"node {node_id[:12]} is already a member; drop_node it first")
            actor: Any = ray.remote(WeightAgent)
            agent: Any = actor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                num_cpus=0,
                max_concurrency=4,
                max_restarts=0,
            ).remote(node_id)
            member = NodeLink(node_id, agent, tuple(slots))
            times = [time.monotonic()]
            try:
                if sockets:
                    info = self._call(member, agent.attach.remote([str(s) for s in sockets]))
                elif serve_dir is not None and self.layout is not None:
                    info = self._call(member, agent.serve.remote(self.layout.to_json(), str(serve_dir)))
                else:
                    raise WeightSyncError(
                        f"node {node_id[:12]}: give its weight server sockets, or serve_dir once a node "
                        "with sockets has told the table"
                    )
                layout = WeightLayout.from_json(info["layout"])
                if self.layout is None:
                    self.layout = layout
                elif layout != self.layout:
                    raise WeightSyncError(f"node {node_id[:12]}: its weight servers have another table")
                times.append(time.monotonic())
                self._connect(member)
                times.append(time.monotonic())
                if self._flat is not None:
                    self._transfer(member, self.version, self._flat)
                else:
                    member.checksum = str(info["live"][0]["checksum"]) if info["live"] else ""
            except WeightSyncError as exc:
                ray.kill(agent, no_restart=True)
                raise self._join_error(node_id, exc) from exc
            except BaseException:
                ray.kill(agent, no_restart=True)
                raise
            times.append(time.monotonic())
            self.last_join = {
                "node_id": node_id,
                "agent_start_s": times[1] - times[0],
                "rendezvous_s": times[2] - times[1],
                "transfer_s": times[3] - times[2],
            }
            self.members[node_id] = member
            self.dropped.pop(node_id, None)
            if self._flat is not None:  # its slots hold the current version now: back in rotation
                report_versions(self.router_url, self.admin_token, member.slots, self.version)
            return WeightReport(node_id, member.generation, member.version, member.checksum)

    def attach(self, node_id: str, sockets: Sequence[str | Path], slots: Sequence[str] = ()) -> list[str]:
        """Add a member node's new slots (their weight servers); returns their live checksums.

        Each must already hold the current version (start the slot from `write_weights_file`):
        otherwise the agent forgets them again, their slots are marked unhealthy and
        WeightSyncError is raised. Attached slots are reported at the current version to the router.
        """
        with self._lock:
            member = self._member(node_id)
            info = self._call(member, member.agent.attach.remote([str(s) for s in sockets]))
            found = [str(live["checksum"]) for live in info["live"]]
            if self.version > 0 and any(value != self.checksum for value in found):
                # refused: the agent forgets these servers (an update must not write to them) and
                # the slots leave the router's rotation for good
                self._call(member, member.agent.detach.remote([str(s) for s in sockets]))
                self._fence(slots)
                raise WeightSyncError(
                    f"node {node_id[:12]}: slots {list(slots)} hold {found}, not version {self.version} "
                    f"({self.checksum}); start a slot from write_weights_file(...)"
                )
            member.slots += tuple(slots)
            if self.version > 0:  # at the current version: it may serve (held out until then)
                report_versions(self.router_url, self.admin_token, slots, self.version)
            return found

    def detach(self, node_id: str, sockets: Sequence[str | Path], slots: Sequence[str] = ()) -> None:
        """Forget a member node's stopped slots (their weight servers); the node stays a member."""
        with self._lock:
            member = self._member(node_id)
            self._call(member, member.agent.detach.remote([str(s) for s in sockets]))
            member.slots = tuple(s for s in member.slots if s not in set(slots))

    def write_weights_file(self, node_id: str, path: str | Path) -> str:
        """Write the node's committed current version to `path` (safetensors, on that node), the
        `weights` a new slot there starts from; returns its checksum (equal to the trainer's)."""
        with self._lock:
            member = self._member(node_id)
            written = str(self._call(member, member.agent.save_safetensors.remote(str(path))))
            if self.version > 0 and written != self.checksum:
                raise WeightSyncError(f"node {node_id[:12]} wrote {written}, not version {self.version}")
            return written

    def drop_node(self, node_id: str, reason: str = "dropped by the caller") -> None:
        """Remove a node: its agent is killed; its slots keep serving while their version is the
        current one and are held out by the router from the next update on (until it rejoins)."""
        with self._lock:
            self._drop(self._member(node_id), reason)

    # -- updates ------------------------------------------------------------------------------

    def update(
        self, tensors: Mapping[str, torch.Tensor], *, after_chunk: AfterChunk | None = None
    ) -> WeightUpdateResult:
        """Send `tensors` as the next version to every member node; returns when each has committed
        it or has been dropped. `after_chunk(node_id, index)` runs after each chunk is sent (chaos).

        Raises WeightSyncTimeoutError / WeightSyncError (naming the nodes) when no node committed.
        """
        with self._lock:
            if not self.members or self.layout is None:
                raise WeightSyncError("no node to update: add_node first")
            start = time.monotonic()
            # two pack buffers: a failed pack never touches the current version a joining node gets
            flat = pack(tensors, self.layout, self._spare)
            version, value = self.version + 1, checksum(flat)
            pack_s = time.monotonic() - start
            self.version, self.checksum, self._flat, self._spare = version, value, flat, self._flat
            reports, reasons = self._send_all(list(self.members.values()), version, flat, after_chunk)
            for node_id, reason in reasons.items():
                self._drop(self.members[node_id], reason)
            for report in reports:
                report_versions(
                    self.router_url, self.admin_token, self.members[report.node_id].slots, version
                )
            # the barrier: from here on only slots at `version` serve, the dropped ones are held out
            require_version(self.router_url, self.admin_token, version)
            self.num_updates += 1
            self.last_update_s = time.monotonic() - start
            if not reports:
                raise WeightSyncTimeoutError(
                    f"no node committed version {version}: {reasons}; every node was dropped (a router "
                    f"requires version {version}: no slot serves until a node holds it); add_node them "
                    "again before the next rollout",
                    tuple(reasons),
                )
            return WeightUpdateResult(
                version,
                value,
                int(flat.numel()),
                self.last_update_s,
                tuple(reports),
                tuple(reasons),
                reasons,
                pack_s,
            )

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Versions and checksums by node (the run report prints it): `{version, checksum, nbytes,
        num_updates, last_update_s, nodes: [{node_id, generation, version, checksum, current,
        slots}], dropped: {node_id: reason}}`."""
        nodes = [
            {
                "node_id": m.node_id,
                "generation": m.generation,
                "version": m.version,
                "checksum": m.checksum,
                "current": m.version == self.version,
                "slots": list(m.slots),
            }
            for m in self.members.values()
        ]
        return {
            "version": self.version,
            "checksum": self.checksum,
            "nbytes": 0 if self.layout is None else self.layout.slot_bytes,
            "num_updates": self.num_updates,
            "last_update_s": self.last_update_s,
            "nodes": nodes,
            "dropped": dict(self.dropped),
        }

    def verify(self) -> dict[str, list[str]]:
        """Read every member's weight servers back: {node_id: [checksum of each live slot]}."""
        with self._lock:
            return {
                node_id: [str(live["checksum"]) for live in self._call(member, member.agent.live.remote())]
                for node_id, member in self.members.items()
            }

    def metrics(self) -> dict[str, float]:
        """Numbers for a metrics line: version, checksum (crc32 as an integer), nodes, current nodes,
        dropped nodes, last update seconds."""
        current = sum(1 for m in self.members.values() if m.version == self.version)
        crc = int(self.checksum.removeprefix("crc32:"), 16) if self.checksum else 0
        return {
            "weights_version": float(self.version),
            "weights_checksum_crc32": float(crc),
            "weights_nodes": float(len(self.members)),
            "weights_nodes_current": float(current),
            "weights_nodes_dropped": float(len(self.dropped)),
            "weights_update_s": self.last_update_s,
        }

    def close(self) -> None:
        """Close every agent (they detach; their own servers stop) and forget the groups.

        Waits at most 30 s (or `timeout_s`) for all of them together; a hung agent is killed (its own
        server then stops through its guard)."""
        with self._lock:
            refs = [m.agent.close.remote() for m in self.members.values()]
            if refs:
                with contextlib.suppress(RayError):  # a node gone already: its agent is killed below
                    ray.wait(refs, num_returns=len(refs), timeout=min(30.0, self.timeout_s))
            for member in self.members.values():
                ray.kill(member.agent, no_restart=True)
            self.members.clear()
            self._flat = self._spare = None

    # -- internals ----------------------------------------------------------------------------

    def _member(self, node_id: str) -> NodeLink:
        if node_id not in self.members:
            raise WeightSyncError(f"node {node_id[:12]} is not a member; add_node it first")
        return self.members[node_id]

    def _call(self, member: NodeLink, ref: Any) -> Any:
        return call(member, ref, self.timeout_s)

    def _connect(self, member: NodeLink) -> None:
        self._next_generation += 1
        host = self.host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        connect(member, self._next_generation, host, self.timeout_s)

    def _send_all(
        self, members: list[NodeLink], version: int, flat: torch.Tensor, after_chunk: AfterChunk | None
    ) -> tuple[list[WeightReport], dict[str, str]]:
        return send_all(
            members,
            version,
            flat,
            expected=self.checksum,
            chunk_bytes=self.chunk_bytes,
            timeout_s=self.timeout_s,
            after_chunk=after_chunk,
        )

    def _transfer(self, member: NodeLink, version: int, flat: torch.Tensor) -> None:
        """Send the whole current version to one member (a node joining); raises on any failure."""
        _, reasons = self._send_all([member], version, flat, None)
        if reasons:
            raise WeightSyncTimeoutError(
                f"node {member.node_id[:12]}: {reasons[member.node_id]}", (member.node_id,)
            )

    def _join_error(self, node_id: str, exc: WeightSyncError) -> WeightSyncError:
        """Why `node_id` could not join, naming it and the members (whose groups are untouched)."""
        members = [member[:12] for member in self.members]
        message = (
            f"node {node_id[:12]} could not join the weight sync (a fresh rendezvous, then version "
            f"{self.version} in full): {exc}. It is not a member (none of its slots is reported to "
            f"the router at a version); the members {members} keep their groups. Check the node, then "
            "add_node it again (or go on without it)"
        )
        if isinstance(exc, WeightSyncTimeoutError):
            return WeightSyncTimeoutError(message, exc.nodes)
        return WeightSyncError(message)

    def _drop(self, member: NodeLink, reason: str) -> None:
        self.members.pop(member.node_id, None)
        self.dropped[member.node_id] = reason
        member.group = None
        ray.kill(member.agent, no_restart=True)

    def _fence(self, slots: Sequence[str]) -> None:
        fence(self.router_url, self.admin_token, slots)
