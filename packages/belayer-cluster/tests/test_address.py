"""Joining an existing Ray cluster by address (`connect`), tested against a real one.

The cluster is a Ray head started outside the code under test, the way an operator starts one
(`belayer_cluster.testing.RayHead`: `ray start --head` in its own session and temp folder). A
separate driver process joins it by address, runs slots and a rollout, and leaves; the cluster
keeps running, and the test stops it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import PROMPTS, gone, wait_until

from belayer_cluster import ClusterConfigError, connect
from belayer_cluster.testing import RayHead

pytestmark = pytest.mark.timeout(600)
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def head() -> Iterator[RayHead]:
    ray_head = RayHead(num_cpus=2).start()
    try:
        yield ray_head
    finally:
        leader = ray_head.pid
        ray_head.stop()
        assert ray_head.processes() == []
        assert gone(leader)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(address: str) -> tuple[int, dict[str, Any]]:
    argv = [sys.executable, "-m", "belayer_cluster", "status", "--address", address, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    return done.returncode, json.loads(done.stdout) if done.stdout else {"stderr": done.stderr}


def test_a_driver_joins_by_address_and_leaves_the_cluster_running(head: RayHead) -> None:
    # Unix socket paths are short: the shared folder is too.
    with tempfile.TemporaryDirectory(prefix="bca-", dir="/tmp") as shared:
        done = subprocess.run(
            [sys.executable, str(TESTS / "address_driver.py"), head.address, shared],
            capture_output=True,
            text=True,
            timeout=540,
            cwd=TESTS,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    (node,) = report["nodes"]  # the head is the cluster's only node
    assert report["slot_nodes"] == {"a": node, "b": node}
    assert len(report["tokens"]) == len(PROMPTS)
    assert all(len(tokens) == 24 for tokens in report["tokens"])
    assert all(indices == list(range(24)) for indices in report["indices"])
    assert report["cpus_free_after_stop"] == report["cpus_total"] == 2.0
    # The driver's slots are gone, the cluster it joined is not.
    slot_pids = [pid for pids in report["pids"].values() for pid in pids]
    wait_until(lambda: all(gone(pid) for pid in slot_pids), 60, "the driver's slot processes to exit")
    assert head.alive()
    code, status = _status(head.address)
    assert code == 0, status
    assert [(n["node_id"], n["alive"]) for n in status["nodes"]] == [(node, True)]


def test_an_address_where_no_cluster_answers_is_a_clear_error_that_names_it() -> None:
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(ClusterConfigError, match=f"no Ray cluster answers at {address}"):
        connect(address, connect_timeout_s=5.0)
    with pytest.raises(ClusterConfigError, match="must be HOST:PORT \\(got 'nohostport'\\)"):
        connect("nohostport")
