"""Nodes that share nothing (`IsolatedRayCluster`): what a node sees of the others and of the host,
and a network partition: the cut node's slot is fenced and never serves again, its sandbox is
restored elsewhere (into the other node's spare container) and its old container is never used
again, the node ends when it comes back (its spare with it).

The module shares the session's cluster (conftest) with test_weightsync.py (same Ray settings).
The kill of a whole node is test_cluster.py's node-removal test (on this cluster too).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from cluster_helpers import PROMPTS, TOKEN, Rollout, rollout, wait_until
from conftest import ISOLATED
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from belayer_cluster import (
    DriverRouter,
    IsolatedRayCluster,
    RolloutCluster,
    SandboxCluster,
    clean_stale_clusters,
)
from belayer_envckpt import CheckpointStore, Engine, full_restore
from belayer_router.testing import process_gone

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not ISOLATED, reason="needs root and iproute2 (network and mount namespaces)"),
]
MAX_TOKENS = 160
SLOT_OPTIONS = {"num_kv_blocks": 256, "stale_s": 5.0}
WITH_SANDBOXES = True
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
# What a process in a sandbox sees of it: every entry outside the per-container ones (/proc, /sys,
# /dev, the engine's /etc files), the kept file's mtime and contents, every process's command line.
SANDBOX_STATE = (
    "find / -xdev ! -path '/proc*' ! -path '/sys*' ! -path '/dev*' ! -path '/etc/host*' "
    "! -path '/etc/resolv.conf' ! -path '/etc' ! -path / -exec stat -c '%n %f %u:%g %s' {} + | sort; "
    "stat -c %Y /kept.txt; md5sum /kept.txt; "
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -v -e /proc/ -e '^$' | sort"
)


@ray.remote(num_cpus=0)
def _look_around(shared: str, mark: str) -> dict[str, Any]:
    """What a process of a node sees: its name, address, pid, /tmp and /dev/shm, the shared folder."""
    Path("/tmp", mark).write_text(mark)
    Path("/dev/shm", mark).write_text(mark)
    Path(shared, mark).write_text(mark)
    try:
        Path(sys.prefix, mark).write_text(mark)
        env_error = 0
    except OSError as exc:
        env_error = exc.errno or 0
    return {
        "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        "pid": os.getpid(),
        "tmp": sorted(os.listdir("/tmp")),
        "shm": sorted(os.listdir("/dev/shm")),
        "shared": sorted(os.listdir(shared)),
        "env_error": env_error,
    }


@pytest.fixture(scope="module")
def router(local_ray: IsolatedRayCluster, shared_dir: Path) -> Iterator[DriverRouter]:
    """This module's router is a process of a node (nsenter into its namespaces), listening on a
    service address of the cluster's subnet that moves with it; its journal is on the shared folder."""
    address, home = local_ray.free_address(), local_ray.node_ids[-1]
    local_ray.move_address(address, home)
    with DriverRouter(
        shared_dir / "router.jsonl", admin_token=TOKEN, host=address, launcher=local_ray.launcher(home)
    ) as driver_router:
        yield driver_router


def _runs_router(pid: int) -> bool:
    try:
        return b"belayer_router" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def test_nodes_share_only_the_network_and_the_shared_folder(
    local_ray: IsolatedRayCluster, shared_dir: Path
) -> None:
    first, second = local_ray.node_ids[:2]
    seen = {
        node: ray.get(
            _look_around.options(scheduling_strategy=_on(node)).remote(str(shared_dir), f"mark-{i}")
        )
        for i, node in enumerate((first, second))
    }
    for i, node in enumerate((first, second)):
        view, info = seen[node], local_ray.node(node)
        assert (view["hostname"], view["ip"]) == (info.name, info.ip)  # its own name and address
        mark, other = f"mark-{i}", f"mark-{1 - i}"
        assert mark in view["tmp"]
        assert other not in view["tmp"]
        assert mark in view["shm"]
        assert other not in view["shm"]
        assert not Path("/tmp", mark).exists()
        assert not Path("/dev/shm", mark).exists()
        assert view["env_error"] == errno.EROFS  # the Python environment is read-only
        # Its own PID namespace: its pid means another process on the host.
        host = local_ray.host_pid(node, view["pid"])
        assert host not in (0, view["pid"])
        assert host in local_ray.node_processes(node)
        other_node = second if node == first else first
        assert not set(local_ray.node_processes(node)) & set(local_ray.node_processes(other_node))
    # The shared folder is one: the host sees both marks, the second node saw the first's.
    assert {"mark-0", "mark-1"} <= set(os.listdir(shared_dir))
    assert "mark-0" in seen[second]["shared"]
    assert seen[first]["ip"] != seen[second]["ip"]
    assert local_ray.node(first).name != local_ray.node(second).name


def test_the_router_lost_with_its_node_restarts_on_its_journal_on_another_node(
    local_ray: IsolatedRayCluster, slots: RolloutCluster, router: DriverRouter
) -> None:
    reference = rollout(router.url, PROMPTS[:3], MAX_TOKENS).tokens
    address = router.url.rsplit(":", 1)[0].removeprefix("http://")
    slot_nodes = {info.node_id for info in slots.infos.values()}
    spare = next(node for node in local_ray.node_ids if node not in slot_nodes)
    # First to the node without slots: killed there as a process, started there on its journal.
    router.kill()
    local_ray.move_address(address, spare)
    router.launcher = local_ray.launcher(spare)
    router.start()
    url = router.url
    streams = Rollout(router.url, PROMPTS[:3], MAX_TOKENS).start()
    streams.wait_tokens(4)
    # Its machine is lost whole (the router and everything else of the node at once); it starts on
    # slot a's node on the same journal, at the same service address.
    local_ray.kill_node(spare)
    router.kill()  # already gone with its node: only the handle is let go
    local_ray.move_address(address, slots.infos["a"].node_id)
    router.launcher = local_ray.launcher(slots.infos["a"].node_id)
    router.start()
    assert router.url == url
    streams.join(240)
    assert streams.tokens == reference  # every stream completes exactly, as without the loss
    assert all(indices == list(range(MAX_TOKENS)) for indices in streams.indices)
    # The router is a process of slot a's node now (its PID namespace), not of the host's.
    assert any(_runs_router(pid) for pid in local_ray.node_processes(slots.infos["a"].node_id))
    workers = httpx.get(f"{router.url}/workers", headers=ADMIN, timeout=30).json()["slots"]
    assert {w["slot"]: w["healthy"] for w in workers} == {"a": True, "b": True}


def test_a_partitioned_node_is_fenced_and_never_serves_again(
    local_ray: IsolatedRayCluster,
    slots: RolloutCluster,
    router: DriverRouter,
    sandboxes: SandboxCluster,
) -> None:
    reference = rollout(router.url, PROMPTS, MAX_TOKENS).tokens
    victim, survivor = slots.infos["b"], slots.infos["a"].node_id
    sandboxes.keep_spares(1)  # restores go into a started spare container of their node
    box = sandboxes.create("traj-p", victim.node_id)
    sandboxes.warm_spares()  # create asked every node for one; ready now
    sandboxes.exec("traj-p", "echo kept > /kept.txt")
    assert sandboxes.checkpoint("traj-p", "traj-p/turn-1").prefix == 1
    owned = local_ray.containers(victim.node_id)  # labelled with its node: its sandbox and its spare
    assert len(owned) == 2
    assert box.container_id in owned
    streams = Rollout(router.url, PROMPTS, MAX_TOKENS).start()
    streams.wait_tokens(4)
    cut_at = local_ray.cut(victim.node_id)
    (loss,) = slots.wait_node_loss(1, timeout_s=120)
    detected = loss.detected_at - cut_at
    streams.join(240)
    healed_at = local_ray.heal(victim.node_id)
    # The healthy side did not wait on the cut node beyond its detection: every stream finished,
    # exactly the failure-free output, the ones on b resumed on a after the loss was handled.
    assert streams.tokens == reference
    assert loss.node_id == victim.node_id
    assert loss.slots == ("b",)
    assert detected >= 0
    assert loss.slots_left == ("a",)
    # Fenced: b is out at the router for good; no epoch brings it back, not even a newer one.
    for epoch in (1, 10**6):
        refused = httpx.post(
            f"{router.url}/workers/register",
            json={"slot": "b", "url": victim.main_url, "epoch": epoch},
            headers=ADMIN,
            timeout=30,
        )
        assert refused.status_code == 409, refused.text
        assert "unhealthy" in refused.text
    # The node comes back, hears from Ray that it was declared dead, and ends: every process of
    # it, and the containers it owned.
    wait_until(lambda: not local_ray.node_running(victim.node_id), 120, "the fenced node to end")
    assert local_ray.node_processes(victim.node_id) == []
    wait_until(lambda: local_ray.containers(victim.node_id) == [], 60, "the node's containers removed")
    local_ray.forget(victim.node_id)
    # Its sandbox lives on elsewhere from the checkpoint, in the survivor's spare; the old
    # container is never used again.
    (restore,) = loss.sandboxes
    assert (restore.to_node, restore.into_spare) == (survivor, True)
    assert restore.container_id != box.container_id
    assert box.container_id not in sandboxes.containers()
    _restores_into_a_spare_as_a_normal_restore(sandboxes, survivor)
    assert sandboxes.exec("traj-p", "cat /kept.txt").stdout == "kept\n"
    workers = httpx.get(f"{router.url}/workers", headers=ADMIN, timeout=30).json()["slots"]
    assert {w["slot"]: w["healthy"] for w in workers} == {"a": True, "b": False}
    assert rollout(router.url, PROMPTS[:2], MAX_TOKENS).tokens == reference[:2]
    print(f"partition: detected {detected:.1f} s after the cut, healed {healed_at - cut_at:.1f} s after it")


def _restores_into_a_spare_as_a_normal_restore(sandboxes: SandboxCluster, node_id: str) -> None:
    """traj-p's sandbox killed on `node_id` comes back into that node's spare, in the state a
    normal restore (a new container, started) of the same checkpoint has."""
    ckpt = CheckpointStore(sandboxes.store_dir).latest_ready("traj-p")
    assert ckpt is not None
    assert ckpt.kind == "fresh-runtime"
    killed = sandboxes.where("traj-p")
    sandboxes.control("traj-p", "kill")
    sandboxes.warm_spares()  # the spare the loss's restore took was refilled in the background
    spared = sandboxes.restore("traj-p", ckpt, replacing=killed.container_id)
    sandboxes.remove("traj-p", killed.container_id)
    assert (spared.node_id, spared.prefix) == (node_id, 1)
    assert "spare_ms" in spared.restore_timings_ms
    engine = Engine.connect()
    try:
        normal = full_restore(ckpt, engine=engine, remove_failed=False)
        try:
            assert "spare_ms" not in normal.restore_timings_ms
            seen = sandboxes.probe("traj-p", ["/bin/sh", "-c", SANDBOX_STATE]).stdout
            assert "/kept.txt" in seen  # the tree, the file's mtime and hash, the init's processes
            assert seen.count("\n") > 20
            assert seen == normal.probe(SANDBOX_STATE).stdout
        finally:
            normal.remove()
    finally:
        engine.close()


def test_a_node_whose_raylet_was_too_slow_to_register_is_started_again(
    local_ray: IsolatedRayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `ray start` gives its raylet a fixed 30 s to register; on a loaded machine it can give up
    # ("The current node timed out during startup"). The cluster starts such a node again instead
    # of failing: here the first try of a new node says so and exits at once.
    real_spawn = local_ray._spawn
    tries: list[int] = []

    def spawn(node: Any) -> None:
        tries.append(node.index)
        if len(tries) == 1:
            real = node.argv
            said = "echo 'Exception: The current node timed out during startup.'; sleep 1; exit 1"
            node.argv = [*real[: real.index("--") + 1], "sh", "-c", said]  # in the node's init as ever
            try:
                real_spawn(node)
            finally:
                node.argv = real
        else:
            real_spawn(node)

    monkeypatch.setattr(local_ray, "_spawn", spawn)
    node_id = local_ray.add_node()
    try:
        assert len(tries) == 2
        assert tries[0] == tries[1]  # the same node (address, namespace) started again
        assert local_ray.node_running(node_id)
        assert any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    finally:
        local_ray.kill_node(node_id)


def test_what_a_dead_owners_cluster_left_is_cleaned_up() -> None:
    """belayer-grpo's guardian calls `clean_stale_clusters` after a SIGKILL of its trainer (the
    owner): the nodes' namespaces, veths, the bridge, the head's folder and the record all go."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid whose process is gone
    cluster_id = secrets.token_hex(3)[:5]
    netns, veth, bridge = f"bln{cluster_id}-2", f"blv{cluster_id}02", f"blb{cluster_id}"
    for argv in (
        ["ip", "netns", "add", netns],
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", f"blp{cluster_id}02"],
        ["ip", "link", "set", veth, "master", bridge],
    ):
        subprocess.run(argv, check=True)
    head_folder = Path(f"/tmp/bli{cluster_id}-test")
    head_folder.mkdir()
    record = Path("/run/belayer-isolated", f"{cluster_id}.json")
    record.parent.mkdir(parents=True, exist_ok=True)
    # The head's session outlives its leader (`ray start --head`, SIGKILLed): a member that carries
    # no marker of its owner (as Ray's dashboard agent) must go too.
    leader = subprocess.run(
        ["setsid", "sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $$ $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    session, member = (int(word) for word in leader.stdout.split())
    record.write_text(
        json.dumps(
            {"id": cluster_id, "owner": dead.pid, "bridge": bridge, "netns": [netns], "pids": []}
            | {"head_session": session}
        )
    )

    assert cluster_id in clean_stale_clusters()
    deadline = time.monotonic() + 10
    while not process_gone(member) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(member)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert cluster_id not in links
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert netns not in namespaces
    assert not head_folder.exists()
    assert not record.exists()
