"""Training on Ray (belayer-cluster): a local cluster of 2 simulated nodes, one of them removed
mid-rollout; the run continues on the slot that is left and its report says what the loss cost.
Every weight update goes through belayer-cluster's WeightSync: checksums equal on every live node.
`cluster.address` joins an existing cluster: a Ray head started outside the run. The agentic
default (tooluse) on Ray: its sandboxes live on the nodes' sandbox hosts, and a lost node's are
restored on another node from their latest ready checkpoint; restores go into the nodes' spare
containers."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from belayer_cluster.testing import RayHead
from belayer_grpo._config import load_config
from belayer_grpo._errors import GrpoConfigError, SystemStartError
from belayer_grpo._run import run_training

pytestmark = pytest.mark.e2e
# Nodes in namespaces of their own (belayer-cluster's IsolatedRayCluster) need root and iproute2.
ISOLATED = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None


def _math_config(tmp_path: Path, *overrides: str) -> list[str]:
    return [
        "data.workload='math'",
        f"system.run_dir={str(tmp_path / 'run')!r}",
        "model.warmup_steps=5",
        "system.num_slots=2",
        "system.checkpoint_every=0",
        "chaos.kill_worker_at_steps=[]",
        "logging.progress=false",
        *overrides,
    ]


def test_a_math_run_on_two_nodes_survives_losing_one(tmp_path: Path) -> None:
    config = load_config(
        None, _math_config(tmp_path, "algorithm.steps=3", "chaos.kill_node_at_step=2", "cluster.nodes=2")
    )
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    assert summary["status"] == "completed", out.getvalue()
    (loss,) = summary["node_losses"]
    assert loss["step"] == 2
    assert loss["slots"] == ["slot1"]
    assert loss["slots_left"] == ["slot0"]  # no spare capacity: training goes on with what is left
    # Ray's node table or the router (slot1's streams broke and its host did not answer),
    # whichever named the node first: never before the removal, and before the loss was handled
    # (detect_s).
    assert loss["detected_by"] in ("ray", "router broken streams")
    assert 0 <= loss["detections_s"][loss["detected_by"]] <= loss["detect_s"]
    assert all(at >= 0 for at in loss["detections_s"].values())
    assert f"seen first by {loss['detected_by']}" in out.getvalue()
    assert loss["tokens_lost"] == 0
    assert loss["requests_resumed"] >= 0
    assert loss["time_to_recover_s"] > 0
    assert "node lost" in out.getvalue()
    assert "requests resumed elsewhere" in out.getvalue()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["healthy_slots"] for m in metrics] == [2, 1, 1]
    # Every step after the loss still got new weights on the slot left.
    assert [m["weight_version"] for m in metrics] == [2, 3, 4]
    assert max(m["logprob_gap"] for m in metrics) < 1e-3
    # Every update went through belayer-cluster's WeightSync: one version and checksum per step,
    # equal on every live node; the lost node left the sync at step 2.
    assert [m["weights_version"] for m in metrics] == [1, 2, 3]
    assert len({m["weights_checksum"] for m in metrics}) == 3
    assert all(m["weights_checksum"].startswith("crc32:") for m in metrics)
    for m in metrics:
        assert {node["checksum"] for node in m["weights_nodes"].values()} == {m["weights_checksum"]}
        assert {node["version"] for node in m["weights_nodes"].values()} == {m["weights_version"]}
    assert [len(m["weights_nodes"]) for m in metrics] == [2, 1, 1]
    assert [m["weights_nodes_dropped"] for m in metrics] == [0, 1, 1]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["node_losses"][0]["tokens_lost"] == 0
    assert report["weights"]["version"] == 3
    assert report["weights"]["checksum"] == metrics[-1]["weights_checksum"]
    assert list(report["weights"]["dropped"]) == [loss["node_id"]]
    assert [node["slots"] for node in report["weights"]["nodes"]] == [["slot0"]]
    assert all(node["current"] for node in report["weights"]["nodes"])


def _spares_ready_from_the_first_sandbox(monkeypatch: pytest.MonkeyPatch) -> set[Any]:
    """The first `create` of each configuration returns once every node's spare for it is ready
    (returns the configurations so warmed).

    A create asks the nodes for spares in the background; under heavy load one may take longer
    than the first ready checkpoint, after which `chaos.kill_node_at_step` removes the node: the
    survivor would then have no spare for the loss's restores to go into. With this, it has.
    """
    from belayer_cluster import SandboxCluster

    create = SandboxCluster.create
    warmed: set[tuple[str, str | None, tuple[tuple[str, str], ...]]] = set()
    warming = threading.Lock()

    def create_then_warm(
        self: SandboxCluster,
        trajectory: str,
        node_id: str | None = None,
        image: str = "belayer/busybox",
        *,
        working_dir: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> Any:
        info = create(self, trajectory, node_id, image, working_dir=working_dir, labels=labels)
        key = (image, working_dir, tuple(sorted((labels or {}).items())))
        with warming:  # the creates beside it (other threads) wait for the same spares
            if key not in warmed:
                self.warm_spares(image, working_dir=working_dir, labels=labels)
                warmed.add(key)
        return info

    monkeypatch.setattr(SandboxCluster, "create", create_then_warm)
    return warmed


@pytest.mark.docker
def test_an_agentic_run_on_two_nodes_restores_the_lost_nodes_sandboxes_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from belayer_envckpt import Engine
    from belayer_grpo._guardian import RUN_LABEL, run_marker

    warmed = _spares_ready_from_the_first_sandbox(monkeypatch)
    run_dir = tmp_path / "run"
    config = load_config(
        None,
        [
            f"system.run_dir={str(run_dir)!r}",  # the default workload: tooluse, in real sandboxes
            "cluster.nodes=2",
            f"cluster.isolated={str(ISOLATED).lower()}",  # the node is killed whole: every process
            "system.num_slots=2",
            "algorithm.steps=1",  # 4 x 4 trajectories: the node goes with several sandboxes in use
            "chaos.kill_node_at_step=1",  # once a sandbox on the node has a ready checkpoint
            "chaos.kill_worker_at_steps=[]",
            "chaos.sandbox_kill_p=0",
            "rollout.env_checkpoint_policy='always'",
            "data.held_out=2",  # evaluated after the loss too: new sandboxes on the node left
            "system.checkpoint_every=0",
            "logging.progress=false",
        ],
    )
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    log = out.getvalue()
    assert summary["status"] == "completed", log
    (loss,) = summary["node_losses"]
    assert (loss["step"], loss["slots"], loss["slots_left"]) == (1, ["slot1"], ["slot0"])
    assert loss["tokens_lost"] == 0
    assert loss["time_to_recover_s"] > 0
    assert loss["detected_by"] in ("ray", "router broken streams")
    assert 0 <= loss["detections_s"][loss["detected_by"]] <= loss["detect_s"]
    assert all(at >= 0 for at in loss["detections_s"].values())
    # The node held a sandbox with a ready checkpoint when it went: restored on the other node from
    # the latest ready checkpoint, tied to its trajectory's LLM context at that prefix.
    assert loss["sandboxes_restored"] >= 1, log
    assert loss["sandboxes_restored"] == len(loss["sandboxes"])
    for restore in loss["sandboxes"]:
        assert restore["from_node"] == loss["node_id"] != restore["to_node"]
        assert restore["prefix"] >= 1
        assert restore["context_ref"].startswith(f"router:contexts/{restore['trajectory']}/")
    assert "sandboxes restored elsewhere" in log
    # Every trajectory that had to recover did so prefix-consistently (the restored sandbox's
    # prefix and repository hash and the router's L_turn agree); none failed.
    lines = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 16
    for line in lines:
        for recovery in line["recoveries"]:
            assert recovery["prefix_consistent"], recovery
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["healthy_slots"] for m in metrics] == [1]  # the loss is handled within step 1
    # The lost node's sandboxes went into the survivor's spare container (rollout.spare_sandboxes,
    # default 1, on every node's sandbox host; ready before the loss, however loaded the machine:
    # `_spares_ready_from_the_first_sandbox`): the first at least.
    # A trajectory's recovery that adopted one says so, counted per step and in the report as on
    # one machine.
    assert warmed  # the run's sandboxes were created through SandboxCluster.create, spares ready
    assert any(restore["into_spare"] for restore in loss["sandboxes"]), loss["sandboxes"]
    recoveries = [recovery for line in lines for recovery in line["recoveries"]]
    into_spare = sum(recovery["into_spare"] for recovery in recoveries)
    assert metrics[0]["env_restores_into_spare"] == into_spare
    report = json.loads((run_dir / "report.json").read_text())
    assert report["env"]["restores_into_spare"] == into_spare
    spared = sum(restore["into_spare"] for restore in loss["sandboxes"])
    print(
        f"into a spare: {spared} of {len(loss['sandboxes'])} loss restores, {into_spare} of {len(recoveries)} recoveries"
    )
    # Nothing of the run is left on any node: every sandbox (restored ones and spares too) is gone.
    engine = Engine.connect()
    try:
        assert engine.list_containers([f"{RUN_LABEL}={run_marker(run_dir)}"]) == []
    finally:
        engine.close()


@pytest.mark.docker
@pytest.mark.timeout(900)  # a hang fails here; without the fix the step waited 300 s and then some
def test_the_default_workload_loses_its_node_within_the_step_even_when_no_checkpoint_comes(
    tmp_path: Path,
) -> None:
    """Issue 33: the default tooluse workload (adaptive checkpoints, which it often does not take)
    with `chaos.kill_node_at_step`: the node goes within the step, whether or not a sandbox on it
    ever had a ready checkpoint, and the run completes (it waited for that checkpoint before)."""
    run_dir = tmp_path / "run"
    config = load_config(
        None,
        [
            f"system.run_dir={str(run_dir)!r}",  # the default workload and checkpoint policy
            "cluster.nodes=2",
            "system.num_slots=2",
            "algorithm.steps=2",
            "chaos.kill_node_at_step=1",
            "chaos.kill_worker_at_steps=[]",
            "chaos.sandbox_kill_p=0",
            "model.warmup_steps=5",
            "data.held_out=2",
            "system.checkpoint_every=0",
            "logging.progress=false",
        ],
    )
    assert config.rollout.env_checkpoint_policy == "adaptive"
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    log = out.getvalue()
    assert summary["status"] == "completed", log
    (loss,) = summary["node_losses"]
    assert (loss["step"], loss["slots"], loss["slots_left"]) == (1, ["slot1"], ["slot0"])
    assert loss["tokens_lost"] == 0
    assert loss["sandboxes_restored"] == len(loss["sandboxes"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Handled before step 1's push (its metrics already count one slot), not after the run's end.
    assert [m["healthy_slots"] for m in metrics] == [1, 1]
    assert [len(m["weights_nodes"]) for m in metrics] == [1, 1]
    lines = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 16
    for line in lines:
        for recovery in line["recoveries"]:
            assert recovery["prefix_consistent"], recovery


def test_a_lost_node_is_replaced_and_its_replacement_serves_the_current_weights(tmp_path: Path) -> None:
    config = load_config(
        None,
        _math_config(
            tmp_path,
            "algorithm.steps=2",
            "chaos.kill_node_at_step=1",
            "cluster.nodes=2",
            "cluster.replace_lost_nodes=true",
        ),
    )
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    assert summary["status"] == "completed", out.getvalue()
    (loss,) = summary["node_losses"]
    assert loss["slots"] == ["slot1"]
    assert loss["tokens_lost"] == 0
    assert "replacement_error" not in loss, loss["replacement_error"]
    replaced = loss["replaced_by"]
    assert replaced["slot"] == "slot1-r"
    assert replaced["node_id"] != loss["node_id"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The replacement joined the sync with step 1's version before step 2's rollout, then served.
    assert (replaced["weights_version"], replaced["weights_checksum"]) == (1, metrics[0]["weights_checksum"])
    assert [m["healthy_slots"] for m in metrics] == [2, 2]
    assert [len(m["weights_nodes"]) for m in metrics] == [2, 2]
    assert replaced["node_id"][:12] in metrics[1]["weights_nodes"]
    for m in metrics:
        assert {node["checksum"] for node in m["weights_nodes"].values()} == {m["weights_checksum"]}
    assert max(m["logprob_gap"] for m in metrics) < 1e-3
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert {tuple(node["slots"]) for node in report["weights"]["nodes"]} == {("slot0",), ("slot1-r",)}


def test_a_run_joins_an_existing_cluster_by_address_and_leaves_it_running(tmp_path: Path) -> None:
    with RayHead(num_cpus=2) as head:  # an operator's cluster: `ray start --head`, outside the run
        config = load_config(
            None, _math_config(tmp_path, "algorithm.steps=1", f"cluster.address={head.address!r}")
        )
        out = io.StringIO()
        summary = anyio.run(lambda: run_training(config, stream=out))
        assert summary["status"] == "completed", out.getvalue()
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1]
        assert [m["healthy_slots"] for m in metrics] == [2]
        assert [m["weights_version"] for m in metrics] == [1]
        # both slots on the head, its only node: one agent, both slots' weight servers at version 1
        report = json.loads((tmp_path / "run" / "report.json").read_text())
        (node,) = report["weights"]["nodes"]
        assert (node["slots"], node["version"], node["current"]) == (["slot0", "slot1"], 1, True)
        assert max(m["logprob_gap"] for m in metrics) < 1e-3
        # the run left; the cluster it joined did not
        assert head.alive()
        argv = [sys.executable, "-m", "belayer_cluster", "status", "--address", head.address, "--json"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert [n["alive"] for n in json.loads(done.stdout)["nodes"]] == [True]
    assert head.processes() == []


def test_an_address_where_no_cluster_answers_fails_the_start_and_names_it(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    config = load_config(None, _math_config(tmp_path, "algorithm.steps=1", f"cluster.address={address!r}"))
    with pytest.raises(SystemStartError, match=f"no Ray cluster answers at {address}"):
        anyio.run(lambda: run_training(config, stream=io.StringIO()))


@pytest.mark.skipif(not ISOLATED, reason="needs root and iproute2 (nodes in namespaces of their own)")
def test_a_math_run_on_isolated_nodes_survives_a_partition_and_the_node_never_serves_again(
    tmp_path: Path,
) -> None:
    """Issue 33: `chaos.partition_node_at_step` cuts slot1's node (a network namespace of its own)
    off for `chaos.partition_s`; Ray declares it dead meanwhile, its slot is fenced, the run goes on
    on slot0; back on the network the node hears it was declared dead and ends."""
    config = load_config(
        None,
        _math_config(
            tmp_path,
            "algorithm.steps=3",
            "cluster.nodes=2",
            "cluster.isolated=true",
            "chaos.partition_node_at_step=2",
            "chaos.partition_s=40",  # longer than the detection (~15 s of health checks here)
        ),
    )
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    assert summary["status"] == "completed", out.getvalue()
    (loss,) = summary["node_losses"]
    assert (loss["fault"], loss["step"], loss["partition_s"]) == ("partition", 2, 40.0)
    assert (loss["slots"], loss["slots_left"]) == (["slot1"], ["slot0"])
    assert loss["detected_by"] in ("ray", "router broken streams")
    assert 0 <= loss["detect_s"] < 40.0  # fenced while cut off, not after the heal
    assert loss["tokens_lost"] == 0
    assert loss["node_ended_after_heal"] is True
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["healthy_slots"] for m in metrics] == [2, 1, 1]  # never serves again
    assert [len(m["weights_nodes"]) for m in metrics] == [2, 1, 1]
    assert max(m["logprob_gap"] for m in metrics) < 1e-3


def test_partition_needs_isolated_nodes() -> None:
    with pytest.raises(GrpoConfigError, match=r"chaos\.partition_node_at_step"):
        load_config(None, ["chaos.partition_node_at_step=2", "cluster.nodes=2", "system.num_slots=2"])
    with pytest.raises(GrpoConfigError, match=r"cluster\.isolated"):
        load_config(None, ["cluster.isolated=true"])
    with pytest.raises(GrpoConfigError, match=r"one node fault per step"):
        load_config(
            None,
            [
                "cluster.nodes=2",
                "cluster.isolated=true",
                "system.num_slots=2",
                "chaos.kill_node_at_step=2",
                "chaos.partition_node_at_step=2",
            ],
        )


def test_kill_node_needs_a_local_cluster_of_two_nodes() -> None:
    with pytest.raises(GrpoConfigError, match=r"chaos\.kill_node_at_step"):
        load_config(None, ["chaos.kill_node_at_step=2", "system.num_slots=2"])
    with pytest.raises(GrpoConfigError, match=r"cluster\.address"):
        load_config(None, ["cluster.nodes=2", "cluster.address='127.0.0.1:6379'"])
    with pytest.raises(GrpoConfigError, match=r"cluster\.replace_lost_nodes"):
        load_config(None, ["cluster.replace_lost_nodes=true"])


def test_the_default_run_does_not_ask_for_ray() -> None:
    from belayer_grpo._cluster import cluster_wanted

    assert not cluster_wanted(load_config(None, []))


@pytest.mark.docker
def test_the_cluster_pool_gives_a_done_trajectorys_sandbox_to_the_next_one(tmp_path: Path) -> None:
    from belayer_cluster import LocalClusterConfig, LocalRayCluster, SandboxCluster
    from belayer_envckpt import CheckpointStore, Engine
    from belayer_grpo._agentic.cluster_pool import ClusterSandboxPool
    from belayer_grpo._agentic.pool import POOL_LABEL

    async def two_trajectories(pool: ClusterSandboxPool) -> list[str]:
        used = []
        async with pool.lease("t-1", "belayer/busybox", "/work") as lease:
            used.append(lease.sandbox.id)
            done = await anyio.to_thread.run_sync(lambda: lease.sandbox.exec("echo 1 > /work/f"))
            assert done.exit_code == 0
        async with pool.lease("t-2", "belayer/busybox", "/work") as lease:
            used.append(lease.sandbox.id)
            assert lease.sandbox.prefix == 0  # a fresh trajectory's sandbox
            found = await anyio.to_thread.run_sync(lambda: lease.sandbox.exec("test -e /work/f"))
            assert found.exit_code == 1  # its working directory was emptied
        return used

    with LocalRayCluster(LocalClusterConfig(num_nodes=1)):
        hosts = SandboxCluster(tmp_path)
        hosts.start()
        engine = Engine.connect()
        pool = ClusterSandboxPool(
            engine, CheckpointStore(hosts.store_dir), capacity=2, reuse=True, hosts=hosts
        )
        try:
            first, second = anyio.run(two_trajectories, pool)
            assert first == second  # t-2 got t-1's container, parked on its node
            assert pool.num_reused == 1
            assert [parked.container_id for parked in hosts.idle] == [first]  # parked again after t-2
            anyio.run(pool.aclose)
        finally:
            hosts.stop()
            mine = engine.list_containers([f"{POOL_LABEL}={pool.pool_id}"])
            engine.close()
    assert mine == []  # the parked sandbox went with the hosts
