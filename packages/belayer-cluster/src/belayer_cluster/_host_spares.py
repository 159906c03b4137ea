"""`HostSpares`: one node's started spare containers, belayer-envckpt's `SparePool` on its host.

A sandbox host keeps up to ``size`` started, untouched containers per sandbox configuration in use
(`SpareSpec`: image, working folder, the caller's labels), shared by every trajectory (a
``shared`` `belayer_envckpt.SparePool`).  A restore of a ``fresh-runtime`` checkpoint on the node
(its own sandbox's, or a lost node's) goes into one (`belayer_envckpt.full_restore(spares=)`)
instead of creating and starting a container; the pool makes a new one in the background.

A spare is created with the configuration a sandbox of this node has (`sandbox_config`): the
node's label (an isolated node owns its containers: they end with it) and the cluster's (its
`SandboxCluster.stop` removes them), and the trajectory label ``spare``.  A checkpoint names the
node its sandbox ran on; a restore puts this node's label over it, so a lost node's checkpoint
fits a survivor's spare.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from belayer_envckpt import Engine, SandboxConfig, SparePool

__all__ = ["HostSpares", "SpareSpec", "sandbox_config"]


def sandbox_config(
    image: str,
    working_dir: str | None,
    labels: Mapping[str, str] | None,
    limits: Mapping[str, Any] | None,
    host_labels: Mapping[str, str],
) -> SandboxConfig:
    """The configuration a host creates a sandbox (and a spare) with: the caller's labels, then the
    host's own (node, cluster) over them."""
    from belayer_envckpt import SandboxConfig, SandboxLimits

    return SandboxConfig(
        image=image,
        working_dir=working_dir or "/",
        labels={**(labels or {}), **host_labels},
        limits=SandboxLimits(**limits) if limits else SandboxLimits(),
    )


@attrs.frozen
class SpareSpec:
    """A sandbox configuration as `SandboxCluster.create` is asked for it (spares are kept per spec)."""

    image: str
    working_dir: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, image: str, working_dir: str | None, labels: Mapping[str, str] | None) -> SpareSpec:
        """The spec of a `create(image, working_dir=, labels=)` call."""
        return cls(image, working_dir or "/", tuple(sorted((labels or {}).items())))


@attrs.define
class HostSpares:
    """The spares of one host: none until `keep` gives a size; `want` names the specs in use.

    `want` calls may arrive out of order (a host serves calls on many threads, and two `create`s
    ask at once): each carries its ask's generation, and one older than the last applied is
    dropped, so the newest set of specs stands.
    """

    engine: Engine
    host_labels: dict[str, str]
    pool: SparePool | None = None
    generation: int = 0  # of the last `want` applied
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def keep(self, size: int) -> None:
        """Keep up to ``size`` spares per spec from now on (0: none); the spares kept so far go."""
        from belayer_envckpt import SparePool

        old, self.pool = self.pool, SparePool(self.engine, size=size, shared=True) if size > 0 else None
        if old is not None:
            old.close()

    def want(self, specs: Sequence[SpareSpec], wait: bool = False, generation: int | None = None) -> int:
        """Spares for ``specs`` (in the background; with ``wait`` ready on return), none for any other
        spec; returns how many spares of other specs were removed (0 without a pool, or when
        ``generation`` is older than one applied already: this ask is stale and changes nothing)."""
        with self._lock:
            if generation is not None:
                if generation < self.generation:
                    return 0
                self.generation = generation
            pool = self.pool
            if pool is None:
                return 0
            configs = [
                sandbox_config(s.image, s.working_dir, dict(s.labels), None, self.host_labels) for s in specs
            ]
            removed = pool.retain(configs)
            for config in configs:
                if wait:
                    pool.wait_idle()
                    pool.warm(config)
                else:
                    pool.refill_later(config)
            return removed

    def close(self) -> None:
        """Wait for the refills in flight and remove every spare."""
        if self.pool is not None:
            self.pool.close()
