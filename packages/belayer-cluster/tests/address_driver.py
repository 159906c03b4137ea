"""A driver that joins an existing Ray cluster by address (`connect`), as a user's driver would.

`python address_driver.py HOST:PORT SHARED_DIR` starts a router of its own and slots "a" and "b"
on the cluster, runs a greedy rollout through the router, stops its slots, waits until the
cluster's CPUs are free again, leaves the cluster and prints one JSON line: the alive nodes, each
slot's node and processes, the rollout's tokens and indices. The cluster itself is left running.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray
from cluster_helpers import PROMPTS, TOKEN, rollout

from belayer_cluster import DriverRouter, RolloutCluster, connect, disconnect

MAX_TOKENS = 24


def main(address: str, shared: Path) -> None:
    connect(address)
    try:
        total_cpus = ray.cluster_resources()["CPU"]
        with DriverRouter(shared / "router.jsonl", admin_token=TOKEN) as router:
            slots = RolloutCluster(
                ["a", "b"],
                router_url=router.url,
                shared_dir=shared,
                admin_token=TOKEN,
                slot_options={"num_kv_blocks": 128, "stale_s": 5.0},
            )
            infos = slots.start()
            try:
                pids = {
                    slot: [info.pid, *ray.get(slots.hosts[slot].pids.remote(), timeout=60).values()]
                    for slot, info in infos.items()
                }
                run = rollout(router.url, PROMPTS, MAX_TOKENS)
            finally:
                slots.stop()
        deadline = time.monotonic() + 120
        while ray.available_resources().get("CPU", 0.0) < total_cpus and time.monotonic() < deadline:
            time.sleep(0.2)
        report = {
            "nodes": [node["NodeID"] for node in ray.nodes() if node["Alive"]],
            "slot_nodes": {slot: info.node_id for slot, info in infos.items()},
            "pids": pids,
            "tokens": run.tokens,
            "indices": run.indices,
            "cpus_total": total_cpus,
            "cpus_free_after_stop": ray.available_resources().get("CPU", 0.0),
        }
    finally:
        disconnect()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
