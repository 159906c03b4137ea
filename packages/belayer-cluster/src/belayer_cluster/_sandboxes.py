"""`SandboxCluster`: one `SandboxHost` per node, a lost node's sandboxes restored on another node."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from belayer_cluster._errors import ClusterStartError, SandboxHostError
from belayer_cluster._host_spares import SpareSpec
from belayer_cluster._sandbox_host import SandboxHost, SandboxInfo

if TYPE_CHECKING:
    from belayer_envckpt import Checkpoint, ExecResult

__all__ = ["SandboxCluster", "SandboxRestore"]


@attrs.frozen
class SandboxRestore:
    """A sandbox of a lost node brought back on another node from its latest ready checkpoint."""

    trajectory: str
    from_node: str
    to_node: str
    container_id: str  # the new container
    prefix: int  # the committed action boundary it resumes at
    context_ref: str  # the LLM context (prefix) it is tied to
    restore_s: float  # fence + restore, seconds
    into_spare: bool = False  # restored into a started spare container of `to_node`

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return attrs.asdict(self)


class SandboxCluster:
    """Sandbox hosts on every node of the Ray cluster this process is connected to.

    Checkpoints go to `shared_dir/checkpoints`, a directory every node reads (an object store
    through an existing library in production). `recover_node(node_id)` fences the lost node's
    containers and restores each of its sandboxes on a surviving node from its latest ready
    checkpoint. Here every simulated node shares the one Docker daemon: a host is its Ray node.
    A done trajectory's sandbox can be kept for the next one (`park`, `take_idle`): its host
    kills its processes but PID 1 and empties its working folder (files elsewhere stay); a lost
    node's parked sandboxes are fenced, not restored. With `keep_spares(n)` every host keeps `n`
    started spare containers per sandbox configuration `create` was asked for lately, and a
    restore on a node (a lost node's sandbox too) goes into one of that node's when it fits.
    """

    def __init__(
        self, shared_dir: Path, *, call_timeout_s: float = 180.0, cluster_id: str | None = None
    ) -> None:
        if call_timeout_s <= 0:
            raise SandboxHostError(f"call_timeout_s must be > 0 (got {call_timeout_s!r})")
        self.store_dir = Path(shared_dir) / "checkpoints"
        self.call_timeout_s = call_timeout_s
        self.cluster_id = cluster_id or uuid.uuid4().hex[:12]
        self.hosts: dict[str, Any] = {}  # node id -> SandboxHost actor handle
        self.placed: dict[str, SandboxInfo] = {}  # trajectory -> where its sandbox runs now
        self.restores: list[SandboxRestore] = []
        self.idle: list[_Idle] = []  # parked sandboxes, to be taken by another trajectory (reuse)
        self._turn = itertools.count()
        self._placing = itertools.count()
        self.spares = 0  # spare containers per configuration on every host (`keep_spares`)
        self._specs: dict[str, SpareSpec] = {}  # trajectory -> the configuration it was created with
        self._asked: frozenset[SpareSpec] = frozenset()  # the configurations the hosts keep spares for
        self._asking = itertools.count(1)  # the generation of each ask for spares: the newest stands
        # A lost node's recovery and a caller's own restore of the same trajectory exclude each other.
        self._moving = threading.RLock()

    def start(self) -> list[str]:
        """Start one host on every alive node that has CPUs; returns their node ids."""
        if not ray.is_initialized():
            raise ClusterStartError("connect to Ray first (ray.init(address=...) or LocalRayCluster)")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        nodes = [
            n["NodeID"]
            for n in ray.nodes()  # type: ignore[no-untyped-call]
            if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0
        ]
        actor = ray.remote(SandboxHost)
        for node_id in nodes:
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self.hosts[node_id] = actor.options(  # type: ignore[attr-defined]
                num_cpus=0, max_concurrency=16, scheduling_strategy=strategy, max_restarts=0
            ).remote(str(self.store_dir), self.cluster_id)
        try:
            for node_id, host in self.hosts.items():
                if self._get(host.node.remote()) != node_id:
                    raise SandboxHostError(f"the host for node {node_id[:12]} landed on another node")
                if self.spares:
                    self._get(host.keep_spares.remote(self.spares))
        except SandboxHostError as exc:
            self.stop()
            raise ClusterStartError(f"a sandbox host did not start: {exc}") from exc
        return list(self.hosts)

    def create(
        self,
        trajectory: str,
        node_id: str | None = None,
        image: str = "belayer/busybox",
        *,
        working_dir: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> SandboxInfo:
        """A sandbox for `trajectory` on `node_id`; with None, on the live nodes in turn (a node
        whose host does not answer is skipped)."""
        if node_id is not None:
            candidates = [node_id]
        else:
            nodes = list(self.hosts)
            if not nodes:
                raise SandboxHostError("no sandbox host is left to create a sandbox on")
            first = next(self._placing) % len(nodes)
            candidates = nodes[first:] + nodes[:first]
        for index, node in enumerate(candidates):
            try:
                info: SandboxInfo = self._get(
                    self._host(node).create.remote(trajectory, image, None, working_dir, labels)
                )
            except _HostLost:
                if index + 1 == len(candidates):
                    raise SandboxHostError(f"the sandbox host of node {node[:12]} is gone") from None
                continue
            with self._moving:
                self.placed[trajectory] = info
            if self.spares:
                self._ask_for_spares(trajectory, SpareSpec.of(image, working_dir, labels))
            return info
        raise SandboxHostError(f"no node to create a sandbox for {trajectory!r} on")  # pragma: no cover

    def keep_spares(self, size: int) -> None:
        """From now on every host keeps up to `size` started spare containers per sandbox
        configuration `create` was asked for (by the trajectories placed now), which restores on its
        node go into (0: none, and those kept go). They carry the cluster's and the node's labels and
        the trajectory label ``spare``; `stop` removes them, and an isolated node's end with it."""
        if size < 0:
            raise SandboxHostError(f"spares must be >= 0 (0: none), got {size}")
        with self._moving:
            self.spares, self._asked, hosts = size, frozenset(), list(self.hosts.values())
        for host in hosts:
            with contextlib.suppress(_HostLost):
                self._get(host.keep_spares.remote(size))

    def warm_spares(
        self,
        image: str = "belayer/busybox",
        *,
        working_dir: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        """Make every host's spares for this configuration ready now (tests, benchmarks; `create`
        otherwise asks for them in the background)."""
        with self._moving:
            self._asked |= {SpareSpec.of(image, working_dir, labels)}
            wanted, hosts = sorted(self._asked, key=repr), list(self.hosts.values())
            generation = next(self._asking)
        for host in hosts:
            with contextlib.suppress(_HostLost):
                self._get(host.want_spares.remote(wanted, True, generation))

    def _ask_for_spares(self, trajectory: str, spec: SpareSpec) -> None:
        """Spares for the configurations the placed trajectories were created with, on every host,
        when that set changed (the others' spares go)."""
        with self._moving:
            self._specs = {t: s for t, s in self._specs.items() if t in self.placed}
            self._specs[trajectory] = spec
            wanted = frozenset(self._specs.values())
            if wanted == self._asked:
                return
            # Taken with the set, under the lock: two `create`s asking at once reach a host in any
            # order, and the host drops an ask older than one it applied (not the newer set).
            self._asked, hosts, generation = wanted, list(self.hosts.values()), next(self._asking)
        for host in hosts:
            with contextlib.suppress(SandboxHostError):  # a spare less only costs a restore time
                self._get(host.want_spares.remote(sorted(wanted, key=repr), False, generation))

    def exec(
        self, trajectory: str, command: str, timeout_s: float = 60.0, *, container_id: str | None = None
    ) -> ExecResult:
        """One action in the trajectory's sandbox, wherever it runs now (with `container_id`: only
        if it still runs in that container)."""
        info = self.where(trajectory)
        result, prefix = self._get(
            self._host(info.node_id).exec.remote(trajectory, command, timeout_s, container_id)
        )
        with self._moving:  # not over a placement a lost node's recovery made meanwhile
            if self.placed.get(trajectory, info).container_id == info.container_id:
                self.placed[trajectory] = attrs.evolve(info, prefix=int(prefix))
        found: ExecResult = result
        return found

    def probe(
        self,
        trajectory: str,
        argv: list[str],
        timeout_s: float = 60.0,
        *,
        workdir: str | None = None,
        container_id: str | None = None,
    ) -> ExecResult:
        """A read-only command in the trajectory's sandbox (not an action)."""
        host = self._host(self.where(trajectory).node_id)
        found: ExecResult = self._get(host.probe.remote(trajectory, argv, timeout_s, workdir, container_id))
        return found

    def control(self, trajectory: str, operation: str, *, container_id: str | None = None) -> str:
        """`kill` / `stop` / `pause` / `unpause` the trajectory's sandbox, or its `status`."""
        host = self._host(self.where(trajectory).node_id)
        done: str = self._get(host.control.remote(trajectory, operation, container_id))
        return done

    def checkpoint(self, trajectory: str, context_ref: str) -> SandboxInfo:
        """Publish a checkpoint of the trajectory's sandbox, tied to its LLM context `context_ref`."""
        info: SandboxInfo = self._get(
            self._host(self.where(trajectory).node_id).checkpoint.remote(trajectory, context_ref)
        )
        self.placed[trajectory] = info
        return info

    def checkpoint_at(
        self,
        trajectory: str,
        context_ref: str,
        prefix: int,
        *,
        probe_argv: list[str] | None = None,
        workdir: str | None = None,
        container_id: str | None = None,
        accept: Callable[[ExecResult], bool] | None = None,
    ) -> tuple[SandboxInfo, Checkpoint, ExecResult | None]:
        """Publish a checkpoint at `prefix` tied to `context_ref`, of the cheapest kind that captures the
        sandbox, after a read-only probe of the same state (`SandboxHost.checkpoint_at`, `accept` as
        there): (where it is, the `belayer_envckpt.Checkpoint`, the accepted probe answer or None
        without a probe)."""
        host = self._host(self.where(trajectory).node_id)
        info, ckpt, probed = self._get(
            host.checkpoint_at.remote(
                trajectory, context_ref, prefix, probe_argv, workdir, container_id, accept
            )
        )
        with self._moving:
            if self.placed.get(trajectory, info).container_id == info.container_id:
                self.placed[trajectory] = info
        return info, ckpt, probed

    def next_kind(self, trajectory: str, *, container_id: str | None = None) -> str | None:
        """The kind a checkpoint of the trajectory's sandbox would take now, asked of its host
        (`SandboxHost.next_kind`); None when it cannot be told."""
        host = self._host(self.where(trajectory).node_id)
        kind: str | None = self._get(host.next_kind.remote(trajectory, container_id))
        return kind

    def where(self, trajectory: str) -> SandboxInfo:
        """Where the trajectory's sandbox runs now."""
        try:
            return self.placed[trajectory]
        except KeyError:
            raise SandboxHostError(f"no sandbox for trajectory {trajectory!r}; create() it first") from None

    def restore(self, trajectory: str, checkpoint: Checkpoint, *, replacing: str = "") -> SandboxInfo:
        """Bring the trajectory's sandbox back from `checkpoint` (a `belayer_envckpt.Checkpoint`):
        on its node if that is alive, else on another. The caller held container `replacing`; if a
        lost node's recovery already restored this very checkpoint elsewhere, that sandbox is the
        answer (no second restore)."""
        with self._moving:
            info = self.placed.get(trajectory)
            if (
                info is not None
                and info.container_id != replacing
                and info.node_id in self.hosts
                and (info.prefix, info.context_ref) == (checkpoint.prefix, checkpoint.context_ref)
            ):
                return info
            nodes = list(self.hosts)
            if info is not None and info.node_id in nodes:
                nodes.remove(info.node_id)
                nodes.insert(0, info.node_id)
            for node in nodes:
                try:
                    restored: SandboxInfo = self._get(self.hosts[node].restore.remote(trajectory, checkpoint))
                except _HostLost:
                    continue
                self.placed[trajectory] = restored
                if info is not None and info.node_id != node:
                    self.restores.append(
                        SandboxRestore(
                            trajectory,
                            info.node_id,
                            node,
                            restored.container_id,
                            restored.prefix,
                            restored.context_ref,
                            0.0,
                            "spare_ms" in restored.restore_timings_ms,
                        )
                    )
                return restored
            raise SandboxHostError(f"no sandbox host is left to restore {trajectory!r} on")

    def remove(self, trajectory: str, container_id: str) -> None:
        """Remove one container of the trajectory: on its node, or (its node lost) fenced from
        another node's host; quiet if it is gone."""
        info = self.placed.get(trajectory)
        order = list(self.hosts)
        if info is not None and info.container_id == container_id and info.node_id in self.hosts:
            order.remove(info.node_id)
            order.insert(0, info.node_id)
        for node in order:
            with contextlib.suppress(SandboxHostError):
                self._get(self.hosts[node].remove.remote(trajectory, container_id))
                return

    def release(self, trajectory: str) -> None:
        """The trajectory is done: remove its current sandbox and forget where it ran."""
        with self._moving:  # not while a lost node's recovery restores it
            info = self.placed.get(trajectory)
            if info is not None:
                self.remove(trajectory, info.container_id)
                self.placed.pop(trajectory, None)

    def recover_node(self, node_id: str) -> list[SandboxRestore]:
        """Fence a lost node's sandboxes and restore each on a surviving node (latest ready
        checkpoint). A sandbox without a ready checkpoint is only fenced: its owner starts it
        afresh from its image. Raises `SandboxHostError` (after trying every sandbox) if one failed."""
        from belayer_envckpt import CheckpointStore

        with self._moving:
            lost_host = self.hosts.pop(node_id, None)
            if lost_host is not None:
                with contextlib.suppress(RayError):
                    ray.kill(lost_host)
            # Only hosts on nodes Ray lists alive: a node lost without slots (nothing reported its
            # loss) must not be picked to restore on.
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # type: ignore[no-untyped-call]
            survivors = [node for node in self.hosts if node in alive]
            idle = [i for i in self.idle if i.node_id == node_id]  # parked there: fenced, not restored
            self.idle = [i for i in self.idle if i.node_id != node_id]
            for parked in idle if survivors else []:  # on the shared daemon here: fence them
                with contextlib.suppress(SandboxHostError):
                    self._get(self.hosts[survivors[0]].remove_container.remote(parked.container_id))
            if survivors:  # its spares (and any container it made) go with it, as on a machine
                with contextlib.suppress(SandboxHostError):
                    self._get(self.hosts[survivors[0]].remove_node_containers.remote(node_id))
            lost = [t for t, info in list(self.placed.items()) if info.node_id == node_id]
            if lost and not survivors:
                raise SandboxHostError(
                    f"node {node_id[:12]} was lost and no node is left to restore {lost} on"
                )
            store = CheckpointStore(self.store_dir)
            done: list[SandboxRestore] = []
            errors: list[str] = []
            for trajectory in lost:
                began = time.monotonic()
                old = self.placed.get(trajectory)
                if old is None or old.node_id != node_id:  # its owner released or replaced it meanwhile
                    continue
                target = survivors[next(self._turn) % len(survivors)]
                host = self.hosts[target]
                try:
                    # The lost machine's container would be gone with it; on the shared daemon, fence it.
                    self._get(host.remove_container.remote(old.container_id))
                    if store.latest_ready(trajectory) is None:
                        continue
                    info: SandboxInfo = self._get(host.restore.remote(trajectory))
                except SandboxHostError as exc:
                    errors.append(str(exc))
                    continue
                self.placed[trajectory] = info
                done.append(
                    SandboxRestore(
                        trajectory,
                        node_id,
                        target,
                        info.container_id,
                        info.prefix,
                        info.context_ref,
                        time.monotonic() - began,
                        "spare_ms" in info.restore_timings_ms,
                    )
                )
            self.restores += done
        if errors:
            raise SandboxHostError(
                f"{len(errors)} sandbox(es) of lost node {node_id[:12]} not restored: {errors[0]}"
            )
        return done

    def park(self, trajectory: str, container_id: str) -> bool:
        """Keep the done trajectory's sandbox (container `container_id`) for another trajectory: its
        host kills every process in it but PID 1, empties its working folder (`belayer_envckpt.Sandbox.reset_for_reuse`) and
        holds it idle (`take_idle`), and the trajectory is forgotten.
        False when it cannot be reused (moved or restored since, its node lost, the reset failed):
        the caller then `release`s the trajectory."""
        with self._moving:
            info = self.placed.get(trajectory)
            if info is None or info.container_id != container_id or info.node_id not in self.hosts:
                return False
            try:
                key = self._get(self.hosts[info.node_id].park.remote(trajectory, container_id))
            except SandboxHostError:
                return False
            if key is None:
                return False
            self.placed.pop(trajectory, None)
            self.idle.append(_Idle(info.node_id, container_id, key[0], key[1]))
            return True

    def take_idle(self, trajectory: str, image: str, working_dir: str) -> SandboxInfo | None:
        """An idle sandbox of `image` and `working_dir` (`park`) handed to `trajectory` (prefix 0),
        or None when there is none (the caller then `create`s one)."""
        with self._moving:
            while True:
                found = next((i for i in self.idle if (i.image, i.working_dir) == (image, working_dir)), None)
                if found is None:
                    return None
                self.idle.remove(found)
                if found.node_id not in self.hosts:
                    continue
                try:
                    info: SandboxInfo = self._get(
                        self.hosts[found.node_id].adopt.remote(found.container_id, trajectory)
                    )
                except SandboxHostError:
                    continue  # stopped while idle: its host removed it
                self.placed[trajectory] = info
                return info

    def containers(self) -> list[str]:
        """Every container of this cluster that exists (any node)."""
        for host in self.hosts.values():
            with contextlib.suppress(SandboxHostError):
                found: list[str] = self._get(host.containers.remote())
                return found
        return []

    def stop(self) -> None:
        """Remove every sandbox (also any a lost node left) and the hosts."""
        leftovers = self.containers()
        for host in self.hosts.values():
            with contextlib.suppress(SandboxHostError):
                self._get(host.stop.remote())
        for host in list(self.hosts.values())[:1]:
            for container_id in leftovers:
                with contextlib.suppress(SandboxHostError):
                    self._get(host.remove_container.remote(container_id))
        for host in self.hosts.values():
            with contextlib.suppress(RayError):
                ray.kill(host)
        self.hosts.clear()

    def _host(self, node_id: str) -> Any:
        try:
            return self.hosts[node_id]
        except KeyError:
            raise SandboxHostError(f"no sandbox host on node {node_id[:12]} (lost, or not a node)") from None

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except SandboxHostError:
            raise
        except RayActorError as exc:
            raise _HostLost(f"a sandbox host is gone: {exc}") from exc
        except RayError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, SandboxHostError):
                raise cause from exc
            raise SandboxHostError(f"a sandbox host call failed: {exc}") from exc


@attrs.frozen
class _Idle:
    """A parked sandbox: where, and what it can serve."""

    node_id: str
    container_id: str
    image: str
    working_dir: str


class _HostLost(SandboxHostError):
    """The host actor died (its node was lost): the caller may try another node."""
