"""Weight sync on a real local Ray cluster (issue 22): agents, gloo groups, real slots and router.

The session's Ray cluster (at least 3 live nodes of 1 CPU, conftest.py), the module's router,
slots "a" and "b" on two nodes and a spare node whose agent has a weight server of its own. The
tests run in file order and build on each other: an update, a handover between updates, a stale node fenced and a new slot that starts from
the current version, a node lost mid-update, a replacement node added (a real new Ray node)
whose slot serves only once it holds the trainer's version; then, with syncs of their own, nodes
that cannot join or answer (typed errors, bounded by the timeout) and a corrupted transfer that is
never committed.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import torch
from cluster_helpers import PROMPTS, TOKEN, gone, rollout, wait_until

from belayer_cluster import (
    DriverRouter,
    LocalRayCluster,
    RolloutCluster,
    WeightSync,
    WeightSyncError,
    WeightSyncTimeoutError,
    start_replacement_slot,
)
from belayer_cluster._weightsync_link import connect
from belayer_cluster._weightsync_pack import checksum, pack
from belayer_gpumem import ServerConfig, ServerProcess, WeightClient

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 24
SLOT_OPTIONS = {"num_kv_blocks": 128, "stale_s": 5.0}  # a loaded machine is no hang


@pytest.fixture(scope="module")
def spare(local_ray: LocalRayCluster, slots: RolloutCluster) -> str:
    used = {info.node_id for info in slots.infos.values()}
    return next(node for node in local_ray.node_ids if node not in used)


@pytest.fixture(scope="module")
def sync(slots: RolloutCluster, router: DriverRouter, shared_dir: Path, spare: str) -> Iterator[WeightSync]:
    weight_sync = WeightSync(timeout_s=60.0, chunk_bytes=256 << 10, router_url=router.url, admin_token=TOKEN)
    try:
        for slot, info in slots.infos.items():
            weight_sync.add_node(info.node_id, sockets=[info.run_dir / "mem" / "weights.sock"], slots=[slot])
        weight_sync.add_node(spare, serve_dir=shared_dir / "agents" / spare[:12])
        yield weight_sync
    finally:
        weight_sync.close()


def weights(sync: WeightSync, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in the servers' table (a trainer step's output, as far as sync cares)."""
    assert sync.layout is not None
    generator = torch.Generator().manual_seed(seed)
    return {
        spec.name: (torch.randn(spec.shape, generator=generator) * 0.1).to(getattr(torch, spec.dtype))
        for spec in sync.layout.tensors
    }


def greedy(router: DriverRouter) -> list[list[int]]:
    return rollout(router.url, PROMPTS, MAX_TOKENS).tokens


def workers(router: DriverRouter) -> dict[str, object]:
    reply = httpx.get(f"{router.url}/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    reply.raise_for_status()
    found: dict[str, object] = reply.json()
    return found


def slot_states(router: DriverRouter) -> dict[str, dict[str, object]]:
    return {s["slot"]: s for s in workers(router)["slots"]}  # type: ignore[attr-defined]


def required_version(router: DriverRouter) -> object:
    return workers(router)["required_version"]


def serving(router: DriverRouter) -> list[str]:
    """The slots in rotation: healthy, registered, at the required version."""
    states = slot_states(router).items()
    return sorted(slot for slot, s in states if s["healthy"] and s["url"] is not None and s["current"])


def test_update_reaches_every_node(sync: WeightSync, router: DriverRouter, slots: RolloutCluster) -> None:
    before = greedy(router)
    result = sync.update(weights(sync, 1))
    assert result.version == 1
    assert result.dropped == ()
    assert len(result.nodes) == 3
    assert {report.checksum for report in result.nodes} == {result.checksum}
    # read back from every weight server's live slot, not just what the agents said
    assert {value for values in sync.verify().values() for value in values} == {result.checksum}
    assert all(len(report.server_versions) == 1 for report in result.nodes)
    # the router's gate: version 1 required, both slots reported at it
    assert required_version(router) == 1
    assert {slot: (s["weight_version"], s["current"]) for slot, s in slot_states(router).items()} == {
        "a": (1, True),
        "b": (1, True),
    }
    after = greedy(router)
    assert after != before, "the slots still serve the old weights after the update"
    status = sync.status()
    assert status["version"] == 1
    assert status["checksum"] == result.checksum
    assert all(node["current"] and node["checksum"] == result.checksum for node in status["nodes"])
    metrics = sync.metrics()
    assert metrics["weights_version"] == 1.0
    assert metrics["weights_nodes_current"] == 3.0
    assert metrics["weights_checksum_crc32"] == float(int(result.checksum.removeprefix("crc32:"), 16))


def test_handover_needs_no_group_change(sync: WeightSync, slots: RolloutCluster) -> None:
    node_a = slots.infos["a"].node_id
    agent_pid = ray.get(sync.members[node_a].agent.pid.remote(), timeout=60)
    generations = {node: member.generation for node, member in sync.members.items()}
    old_main = ray.get(slots.hosts["a"].pids.remote(), timeout=60)["main"]
    ray.get(slots.hosts["a"].kill_main.remote(), timeout=60)
    assert ray.get(slots.hosts["a"].wait_handovers.remote(1), timeout=120) >= 1
    result = sync.update(weights(sync, 2))
    assert result.version == 2
    assert result.dropped == ()
    assert {report.checksum for report in result.nodes} == {result.checksum}
    assert {node: report.generation for node, report in ((r.node_id, r) for r in result.nodes)} == generations
    assert {node: member.generation for node, member in sync.members.items()} == generations
    assert ray.get(sync.members[node_a].agent.pid.remote(), timeout=60) == agent_pid
    assert ray.get(slots.hosts["a"].pids.remote(), timeout=60)["main"] != old_main
    assert {value for values in sync.verify().values() for value in values} == {result.checksum}


def test_a_lagging_node_is_held_out_until_it_rejoins_current(
    sync: WeightSync,
    local_ray: LocalRayCluster,
    router: DriverRouter,
    slots: RolloutCluster,
    shared_dir: Path,
    spare: str,
) -> None:
    node_b = slots.infos["b"].node_id
    agent_pid = local_ray.host_pid(node_b, ray.get(sync.members[node_b].agent.pid.remote(), timeout=60))
    os.kill(agent_pid, signal.SIGSTOP)  # b's agent hangs; b's slot still serves version 2
    sync.timeout_s = 15.0
    try:
        result = sync.update(weights(sync, 3))
    finally:
        sync.timeout_s = 60.0
    assert result.dropped == (node_b,)
    assert "15.0 s" in result.reasons[node_b]
    assert {report.node_id for report in result.nodes} == set(sync.members)
    assert node_b not in sync.members
    assert {report.checksum for report in result.nodes} == {result.checksum}
    wait_until(lambda: gone(agent_pid), 60, "the hung agent killed")
    assert "main" in ray.get(slots.hosts["b"].pids.remote(), timeout=60)  # alive, stale: held out
    states = slot_states(router)
    assert required_version(router) == 3
    assert (states["b"]["healthy"], states["b"]["weight_version"], states["b"]["current"]) == (True, 2, False)
    assert (states["a"]["weight_version"], states["a"]["current"]) == (3, True)
    assert serving(router) == ["a"]
    served = greedy(router)  # the step moved on: only version 3 may answer

    # a new slot on the spare node starts from the version its agent committed, then serves
    path = shared_dir / "agents" / f"{spare[:12]}-v3.safetensors"
    assert sync.write_weights_file(spare, path) == result.checksum
    new = RolloutCluster(
        ["c"],
        router_url=router.url,
        shared_dir=shared_dir,
        admin_token=TOKEN,
        slot_options={**SLOT_OPTIONS, "weights": path},
    )
    try:
        info = new.start()["c"]
        assert info.node_id == spare
        assert sync.attach(spare, [info.run_dir / "mem" / "weights.sock"], ["c"]) == [result.checksum]
        httpx.post(
            f"{router.url}/slots/a/unhealthy", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        ).raise_for_status()
        only_c = greedy(router)
        assert only_c == served, "a request after the update was served by another version than 3"
        with pytest.raises(WeightSyncError, match="not a member"):
            sync.attach(node_b, [info.run_dir / "mem" / "weights.sock"])
    finally:
        new.stop()
    sync.detach(spare, [info.run_dir / "mem" / "weights.sock"], ["c"])
    assert sync.members[spare].slots == ()

    # a slot started from another version (the initial weights) is held out from its registration
    # on (it has no version), and attach refuses it: fenced for good, forgotten by the agent
    stale = RolloutCluster(
        ["e"], router_url=router.url, shared_dir=shared_dir, admin_token=TOKEN, slot_options=SLOT_OPTIONS
    )
    try:
        stale_info = stale.start()["e"]
        assert stale_info.node_id == spare
        state = slot_states(router)["e"]
        assert (state["healthy"], state["weight_version"], state["current"]) == (True, None, False)
        with pytest.raises(WeightSyncError, match="not version 3"):
            sync.attach(spare, [stale_info.run_dir / "mem" / "weights.sock"], ["e"])
        assert slot_states(router)["e"]["healthy"] is False
        assert sync.members[spare].slots == ()
        assert sync.verify()[spare] == [result.checksum]  # only the agent's own server is left
    finally:
        stale.stop()

    # b's node rejoins through a fresh rendezvous with its slot's weight server: it receives version
    # 3 in full, and its slot, held out until now, is back in rotation (it was never fenced)
    spare_generation = sync.members[spare].generation
    joined = sync.add_node(node_b, sockets=[slots.infos["b"].run_dir / "mem" / "weights.sock"], slots=["b"])
    assert (joined.version, joined.checksum) == (3, result.checksum)
    assert joined.generation > spare_generation
    assert sync.verify()[node_b] == [result.checksum]
    states = slot_states(router)
    assert (states["b"]["healthy"], states["b"]["weight_version"], states["b"]["current"]) == (True, 3, True)
    assert serving(router) == ["b"]  # a fenced above, c stopped: b alone serves, at version 3
    assert greedy(router) == served, "slot b came back with another version than 3"


def test_a_node_lost_mid_update_is_dropped_and_the_others_commit(
    sync: WeightSync, local_ray: LocalRayCluster, router: DriverRouter, slots: RolloutCluster, spare: str
) -> None:
    node_a, node_b = slots.infos["a"].node_id, slots.infos["b"].node_id
    spare_generation = sync.members[spare].generation
    assert sync.version == 3
    assert node_b in sync.members  # rejoined in the test before

    def lose_a(node_id: str, index: int) -> None:
        if node_id == node_a and index == 0:
            local_ray.remove_node(node_a)

    result = sync.update(weights(sync, 4), after_chunk=lose_a)
    assert result.version == 4
    assert result.dropped == (node_a,)
    assert {report.node_id for report in result.nodes} == {spare, node_b}
    assert {report.checksum for report in result.nodes} == {result.checksum}
    assert sync.members[spare].generation == spare_generation  # the others' groups stay
    assert {value for values in sync.verify().values() for value in values} == {result.checksum}
    assert set(sync.status()["dropped"]) == {node_a}
    assert required_version(router) == 4
    assert serving(router) == ["b"]  # a was fenced (and is lost), b's slot got version 4


def test_a_replacement_node_joins_in_full_and_its_slot_serves_only_the_current_version(
    sync: WeightSync, local_ray: LocalRayCluster, router: DriverRouter, shared_dir: Path
) -> None:
    # a machine replaces the lost one: a real new Ray node, a custom resource places the slot on it.
    # Ray reschedules the lost node's placement-group bundle (slot a's) onto any free CPU, so the
    # new node has one CPU more than that bundle takes.
    new = local_ray.add_node(num_cpus=2, resources={"replacement": 1.0})
    assert new in local_ray.node_ids
    assert new not in sync.members
    generations = {node: member.generation for node, member in sync.members.items()}
    replacement = start_replacement_slot(
        sync,
        new,
        "d",
        router_url=router.url,
        shared_dir=shared_dir,
        admin_token=TOKEN,
        slot_options=SLOT_OPTIONS,
        resources={"replacement": 1.0},
    )
    try:
        assert replacement.infos["d"].node_id == new
        member = sync.members[new]
        assert member.generation > max(generations.values())  # its own fresh rendezvous
        assert (member.version, member.checksum) == (sync.version, sync.checksum) == (4, sync.checksum)
        assert member.slots == ("d",)
        # the agent's own server and slot d's weight server both hold the trainer's version
        assert sync.verify()[new] == [sync.checksum, sync.checksum]
        assert {node: m.generation for node, m in sync.members.items() if node != new} == generations
        states = slot_states(router)
        assert (states["d"]["healthy"], states["d"]["weight_version"], states["d"]["current"]) == (
            True,
            4,
            True,
        )
        assert serving(router) == ["b", "d"]  # a was lost, c stopped; b and d at version 4
        at_v4 = greedy(router)  # served by b and d, at version 4
        assert all(len(tokens) == MAX_TOKENS for tokens in at_v4)
        result = sync.update(weights(sync, 5))  # the next update reaches the new node like any other
        assert new in {report.node_id for report in result.nodes}
        assert {report.checksum for report in result.nodes} == {result.checksum}
        assert {value for values in sync.verify().values() for value in values} == {result.checksum}
        assert greedy(router) != at_v4, "slots b and d still serve version 4 after the update"
        assert serving(router) == ["b", "d"]
        assert sync.status()["nodes"][-1] == {
            "node_id": new,
            "generation": member.generation,
            "version": 5,
            "checksum": result.checksum,
            "current": True,
            "slots": ["d"],
        }
    finally:
        replacement.stop()


def test_a_node_that_cannot_join_or_answer_is_a_named_error_never_a_hang(
    sync: WeightSync, local_ray: LocalRayCluster, slots: RolloutCluster, shared_dir: Path, spare: str
) -> None:
    # A sync of its own (no router) on the spare node, with a short timeout where a node fails:
    # every failure below ends within it, as a typed error naming the node; the module's sync is
    # untouched.
    lost = slots.infos["a"].node_id
    assert lost in local_ray.removed_node_ids
    members = {node: (m.generation, m.version) for node, m in sync.members.items()}
    other = WeightSync(timeout_s=5.0, layout=sync.layout)
    work = shared_dir / "unjoinable"
    try:
        # a lost node cannot be re-formed: its agent cannot start there
        with pytest.raises(WeightSyncError, match=f"node {lost[:12]} could not join") as joined:
            other.add_node(lost, serve_dir=work / "lost")
        assert "add_node it again" in str(joined.value)
        assert other.members == {}

        # the only member hangs mid-update: no node committed, a timeout error naming it
        other.timeout_s = 120.0  # a loaded machine takes a while to start an agent
        other.add_node(spare, serve_dir=work / "spare-1")
        other.update(weights(other, 7))
        agent = ray.get(other.members[spare].agent.status.remote(), timeout=60)
        agent_pid, server_pid = (local_ray.host_pid(spare, agent[key]) for key in ("pid", "own_server_pid"))
        assert not gone(server_pid)
        os.kill(agent_pid, signal.SIGSTOP)
        other.timeout_s = 5.0
        with pytest.raises(WeightSyncTimeoutError, match="no node committed version 2") as hung:
            other.update(weights(other, 8))
        other.timeout_s = 120.0
        assert hung.value.nodes == (spare,)
        assert spare in str(hung.value)
        assert "5.0 s" in str(hung.value)
        assert other.members == {}
        assert set(other.status()["dropped"]) == {spare}
        wait_until(lambda: gone(agent_pid), 60, "the hung agent killed")
        wait_until(lambda: gone(server_pid), 60, "the killed agent's own weight server stopped")

        # the node rejoins with version 2 in full; then a rendezvous its agent never joins (it
        # hangs): a timeout naming the node and the address; closing the sync ends the hung agent
        other.add_node(spare, serve_dir=work / "spare-2")
        assert other.members[spare].version == 2
        agent = ray.get(other.members[spare].agent.status.remote(), timeout=60)
        agent_pid, server_pid = (local_ray.host_pid(spare, agent[key]) for key in ("pid", "own_server_pid"))
        os.kill(agent_pid, signal.SIGSTOP)
        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with pytest.raises(
            WeightSyncTimeoutError, match=f"node {spare[:12]} did not join the rendezvous at {host}:"
        ) as rendezvous:
            connect(other.members[spare], 99, host, 5.0)
        assert rendezvous.value.nodes == (spare,)
        other.timeout_s = 5.0
        other.close()  # waits for the hung agent no longer than the timeout, then kills it
        assert other.members == {}
        wait_until(lambda: gone(agent_pid), 60, "the hung agent killed")
        wait_until(lambda: gone(server_pid), 60, "the killed agent's own weight server stopped")
    finally:
        other.close()
    assert {node: (m.generation, m.version) for node, m in sync.members.items()} == members


def test_a_version_received_with_another_checksum_is_never_committed(
    sync: WeightSync, shared_dir: Path, spare: str
) -> None:
    # The test's own weight server on the spare node (it outlives the agent, so its live version
    # can be read back after the node is dropped), and a sync of its own attached to it.
    assert sync.layout is not None
    folder = shared_dir / "corrupt"
    folder.mkdir(mode=0o700)  # a weight server's socket folder is private
    (folder / "layout.json").write_text(json.dumps(sync.layout.to_json()))
    socket = folder / "weights.sock"
    server = ServerProcess.start(
        ServerConfig(kind="weights", socket=socket, layout_file=folder / "layout.json")
    )
    other = WeightSync(timeout_s=120.0, chunk_bytes=max(1, sync.layout.slot_bytes // 4), layout=sync.layout)
    try:
        other.add_node(spare, sockets=[socket])
        first = other.update(weights(other, 21))
        assert first.dropped == ()

        def flip_last_byte(node_id: str, index: int) -> None:
            # after the first chunk the rest is still to send: the node receives one flipped byte
            if index == 0:
                assert other._flat is not None
                other._flat[-1] ^= 1

        with pytest.raises(WeightSyncTimeoutError, match="not committed") as refused:
            other.update(weights(other, 22), after_chunk=flip_last_byte)
        assert refused.value.nodes == (spare,)
        client = WeightClient.attach(socket)
        try:
            live = checksum(pack(client.tensors(), sync.layout))
            assert (client.version, live) == (first.nodes[0].server_versions[0], first.checksum)
        finally:
            client.detach()
    finally:
        other.close()
        server.stop(timeout_s=30)
