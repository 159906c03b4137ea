"""The trainer's link to one node: its group's rendezvous, a version sent to many nodes at once.

Every node has its own two-member gloo group with the trainer (rank 0), so one node's failure
breaks only its own transfer; `send_all` runs one send thread per node and waits for each agent's
commit (or its failure, or the deadline), never longer. Through belayer-router's public admin
API, `report_versions` records the version a node's slots committed, `require_version` lets only
slots at the step's version serve (the router's weight-version gate: a slot behind is held out
until it reports the version), and `fence` takes slots out of rotation for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs
import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayError

from belayer_cluster._errors import WeightSyncError, WeightSyncTimeoutError
from belayer_cluster._weightsync_pack import gloo_group
from belayer_router import RouterAdmin, RouterClientError, RouterUnreachableError

__all__ = [
    "AfterChunk",
    "NodeLink",
    "WeightReport",
    "WeightUpdateResult",
    "call",
    "connect",
    "fence",
    "report_versions",
    "require_version",
    "send_all",
    "why",
]

AfterChunk = Callable[[str, int], None]


@attrs.frozen
class WeightReport:
    """What one node's agent committed: the trainer's version and the checksum of its slot."""

    node_id: str
    generation: int
    version: int
    checksum: str
    server_versions: tuple[int, ...] = ()


@attrs.frozen
class WeightUpdateResult:
    """One update: the version, its checksum and size, every node that committed it, those dropped."""

    version: int
    checksum: str
    nbytes: int
    elapsed_s: float
    nodes: tuple[WeightReport, ...]
    dropped: tuple[str, ...]
    reasons: Mapping[str, str] = attrs.field(factory=dict)
    pack_s: float = 0.0  # of elapsed_s: packing the tensors and the trainer's checksum


@attrs.define
class NodeLink:
    """One member node: its agent, its slots, its group with the trainer and what it committed."""

    node_id: str
    agent: Any
    slots: tuple[str, ...]
    generation: int = 0
    version: int = 0
    checksum: str = ""
    group: Any = None


def call(link: NodeLink, ref: Any, timeout_s: float) -> Any:
    """The result of one call to the node's agent; typed errors name the node."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise WeightSyncTimeoutError(
            f"node {link.node_id[:12]}'s agent did not answer within {timeout_s} s (the node hangs or "
            "is overloaded)",
            (link.node_id,),
        ) from exc
    except RayError as exc:
        raise WeightSyncError(f"node {link.node_id[:12]}'s agent failed: {why(exc)}") from exc


def why(exc: RayError) -> str:
    """One line that says why a call to an agent failed: the agent's own error when it raised one
    (Ray's task error text starts with the call's name and a traceback), else Ray's."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if isinstance(cause, Exception) else str(exc)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def connect(link: NodeLink, generation: int, host: str, timeout_s: float) -> None:
    """A fresh rendezvous: a new TCPStore on a free port of `host`, the agent joins as rank 1."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, 0, 2, True, timeout=timeout, wait_for_workers=False)  # type: ignore[attr-defined]
    except RuntimeError as exc:  # torch's DistStoreError and kin: no free port, `host` not this machine's
        raise WeightSyncError(
            f"node {link.node_id[:12]}: the trainer cannot open a rendezvous on {host}: "
            f"{str(exc).splitlines()[0][:200]}; pass WeightSync(host=...) an address of this machine "
            "that every node reaches"
        ) from exc
    ref = link.agent.connect.remote(generation, host, int(store.port), timeout_s)
    try:
        link.group = gloo_group(store, 0, timeout, host)
    except RuntimeError as exc:
        raise WeightSyncTimeoutError(
            f"node {link.node_id[:12]} did not join the rendezvous at {host}:{store.port} within "
            f"{timeout_s} s: {str(exc).splitlines()[0]}",
            (link.node_id,),
        ) from exc
    call(link, ref, timeout_s)
    link.generation = generation


def send_all(
    links: Sequence[NodeLink],
    version: int,
    flat: torch.Tensor,
    *,
    expected: str,
    chunk_bytes: int,
    timeout_s: float,
    after_chunk: AfterChunk | None = None,
) -> tuple[list[WeightReport], dict[str, str]]:
    """Send version `version` (`flat`, checksum `expected`) to every link at once.

    Returns the reports of the nodes that committed it and, by node, why the others did not: a
    failed send, an agent that failed or died (Ray reports it), a wrong checksum, or no commit
    within `timeout_s`. Never waits past that deadline.
    """
    deadline = time.monotonic() + timeout_s
    refs = {
        link.node_id: link.agent.receive.remote(link.generation, version, chunk_bytes, timeout_s, expected)
        for link in links
    }
    send_errors: dict[str, str] = {}
    for link in links:
        # daemon threads: a send to a hung node ends at its group's own timeout, nobody joins it
        threading.Thread(
            target=_send, args=(link, version, flat, chunk_bytes, after_chunk, send_errors), daemon=True
        ).start()
    reports: list[WeightReport] = []
    reasons: dict[str, str] = {}
    pending = {refs[link.node_id]: link for link in links}
    next_probe = time.monotonic() + 0.5
    while pending:
        for ref, link in list(pending.items()):
            if link.node_id in send_errors:
                reasons[link.node_id] = send_errors[link.node_id]
                del pending[ref]
        remaining = deadline - time.monotonic()
        if pending and remaining <= 0:
            for link in pending.values():
                reasons[link.node_id] = f"no commit within {timeout_s} s"
            break
        if not pending:
            break
        if time.monotonic() >= next_probe:  # a lost node's agent may never answer: Ray's node table says so
            next_probe = time.monotonic() + 0.5
            for ref, link in list(pending.items()):
                if link.node_id in _dead_nodes():
                    reasons[link.node_id] = "its node is dead (Ray's node table)"
                    del pending[ref]
            if not pending:
                break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(0.2, remaining))
        for ref in ready:
            link = pending.pop(ref)
            try:
                found = ray.get(ref)
            except RayError as exc:
                reasons[link.node_id] = why(exc)
                continue
            report = WeightReport(
                link.node_id,
                int(found["generation"]),
                int(found["version"]),
                str(found["checksum"]),
                tuple(int(v) for v in found["server_versions"]),
            )
            link.version, link.checksum = report.version, report.checksum
            if report.version != version or report.checksum != expected:
                reasons[link.node_id] = (
                    f"committed version {report.version} with {report.checksum}, expected version "
                    f"{version} with {expected}"
                )
            else:
                reports.append(report)
    return reports, reasons


def _dead_nodes() -> set[str]:
    try:
        return {node["NodeID"] for node in ray.nodes() if not node["Alive"]}  # type: ignore[no-untyped-call]
    except RayError:
        return set()


def _send(
    link: NodeLink,
    version: int,
    flat: torch.Tensor,
    chunk_bytes: int,
    after_chunk: AfterChunk | None,
    errors: dict[str, str],
) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    # This thread holds the group: when the node is dropped, the group's teardown (which waits for
    # a send stuck on a hung peer until the group's timeout) happens here, never in `update`.
    group = link.group
    try:
        for index, start in enumerate(range(0, int(flat.numel()), chunk_bytes)):
            group.broadcast([flat[start : start + chunk_bytes]], options).wait()
            if after_chunk is not None:
                after_chunk(link.node_id, index)
    except Exception as exc:  # gloo raises RuntimeError subclasses; a chaos hook anything
        errors[link.node_id] = f"sending version {version} failed: {str(exc).splitlines()[0][:200]}"


def fence(router_url: str | None, admin_token: str | None, slots: Sequence[str]) -> None:
    """Mark `slots` unhealthy at the router: out of rotation before the next rollout (a slot the
    router does not know was never registered and serves nothing)."""
    if router_url is None or not slots:
        return
    with RouterAdmin(router_url, admin_token) as admin:
        for slot in slots:
            try:
                admin.mark_unhealthy(slot)
            except RouterUnreachableError as exc:
                raise WeightSyncError(
                    f"could not take stale slot {slot!r} out of the router's rotation: {exc}; "
                    "do not start the next rollout until the router is back"
                ) from exc
            except RouterClientError as exc:
                raise WeightSyncError(
                    f"the router refused to take stale slot {slot!r} out of rotation ({exc.status}): "
                    "check the admin token; do not start the next rollout"
                ) from exc


def _admin_call(
    router_url: str, admin_token: str | None, call: Callable[[RouterAdmin], object], what: str
) -> None:
    """One admin call at the router (`RouterAdmin`); `WeightSyncError` when it is away or refuses."""
    try:
        with RouterAdmin(router_url, admin_token) as admin:
            call(admin)
    except RouterUnreachableError as exc:
        raise WeightSyncError(
            f"could not {what} at the router: {exc}; do not start the next rollout until the router is back"
        ) from exc
    except RouterClientError as exc:
        raise WeightSyncError(
            f"the router refused to {what} ({exc.status}: {exc.message[:200]}); check the admin "
            "token and that versions only move forward; do not start the next rollout"
        ) from exc


def report_versions(
    router_url: str | None, admin_token: str | None, slots: Sequence[str], version: int
) -> None:
    """Tell the router that `slots` committed weight version `version` (a slot it does not know,
    never registered, is skipped: it serves nothing)."""
    if router_url is None:
        return

    def report(admin: RouterAdmin) -> None:
        for slot in slots:  # a slot the router does not know (False) serves nothing: skipped
            admin.report_weight_version(slot, version)

    _admin_call(router_url, admin_token, report, f"record version {version} of the slots {list(slots)}")


def require_version(router_url: str | None, admin_token: str | None, version: int) -> None:
    """From now on the router serves new requests only on slots at `version`; the others are held
    out (their streams resume on a current slot) until they report it."""
    if router_url is None:
        return
    _admin_call(
        router_url,
        admin_token,
        lambda admin: admin.require_weight_version(version),
        f"require version {version}",
    )
