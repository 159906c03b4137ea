"""`HostSpares.want`: asks that reach a host out of order leave the newest set of specs (no Ray,
no Docker: belayer-envckpt's `SparePool` is a fake here)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, cast

from belayer_cluster._host_spares import HostSpares, SpareSpec
from belayer_envckpt import SandboxConfig

OLD = SpareSpec.of("belayer/busybox", "/work", None)
NEW = SpareSpec.of("belayer/python", "/work", None)


class FakeSparePool:
    """Records what `HostSpares` asks of belayer-envckpt's `SparePool` (images only)."""

    def __init__(self) -> None:
        self.retained: list[list[str]] = []
        self.refills: list[str] = []

    def retain(self, configs: Iterable[SandboxConfig]) -> int:
        self.retained.append([config.image for config in configs])
        return 0

    def refill_later(self, config: SandboxConfig) -> None:
        self.refills.append(config.image)


def _spares(pool: FakeSparePool) -> HostSpares:
    return HostSpares(cast(Any, None), {"belayer.cluster": "c1"}, cast(Any, pool))


def test_an_older_ask_that_arrives_after_a_newer_one_changes_nothing() -> None:
    # Two creates asked at once: generation 1 wanted the old set, generation 2 the old and the new
    # configuration; the host got them the other way round.
    pool = FakeSparePool()
    spares = _spares(pool)
    spares.want([OLD, NEW], generation=2)
    assert spares.want([OLD], generation=1) == 0
    assert pool.retained == [["belayer/busybox", "belayer/python"]]  # the stale ask removed nothing
    assert pool.refills == ["belayer/busybox", "belayer/python"]
    assert spares.generation == 2
    spares.want([NEW], generation=3)  # a newer ask still applies
    assert pool.retained[-1] == ["belayer/python"]
    spares.want([OLD])  # no generation (a direct caller): always applied
    assert pool.retained[-1] == ["belayer/busybox"]


def test_concurrent_asks_end_with_the_newest_set_whatever_their_order() -> None:
    pool = FakeSparePool()
    spares = _spares(pool)
    specs = {generation: [OLD] if generation % 2 else [OLD, NEW] for generation in range(1, 41)}
    threads = [
        threading.Thread(target=spares.want, args=(specs[g],), kwargs={"generation": g})
        for g in sorted(specs, reverse=True)  # newest first: the worst order
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert spares.generation == 40
    assert pool.retained[-1] == ["belayer/busybox", "belayer/python"]  # generation 40's set
