"""Settings are checked before anything starts: a typed error that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer_cluster import BelayerClusterError, ClusterConfigError, LocalClusterConfig, RolloutCluster


def test_local_cluster_config_defaults_detect_a_dead_node_fast() -> None:
    config = LocalClusterConfig()
    assert config.system_config() == {  # dead in about 5 s instead of Ray's 15 s
        "health_check_period_ms": 1000,
        "health_check_timeout_ms": 2000,
        "health_check_failure_threshold": 5,
        "health_check_initial_delay_ms": 0,
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_nodes", 0),
        ("cpus_per_node", 0),
        ("object_store_bytes", 1024),
        ("health_check_period_s", 0.0),
        ("health_check_timeout_s", -1.0),
        ("health_check_failures", 0),
    ],
)
def test_local_cluster_config_refuses_values_that_cannot_work(field: str, value: float) -> None:
    with pytest.raises(ClusterConfigError, match=field) as info:
        LocalClusterConfig(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, BelayerClusterError)
    assert isinstance(info.value, ValueError)


def test_rollout_cluster_refuses_duplicate_or_missing_slots_and_bad_numbers(tmp_path: Path) -> None:
    for slots in ([], ["a", "a"]):
        with pytest.raises(ClusterConfigError, match="distinct"):
            RolloutCluster(slots, router_url="http://127.0.0.1:1", shared_dir=tmp_path)
    with pytest.raises(ClusterConfigError, match="cpus_per_slot"):
        RolloutCluster(["a"], router_url="http://127.0.0.1:1", shared_dir=tmp_path, cpus_per_slot=0)
