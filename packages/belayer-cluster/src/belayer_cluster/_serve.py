"""`ClusterService`: belayer-shadow's rollout service with its slots on Ray nodes.

    connect(address)  # or LocalRayCluster(...).start()
    async with ClusterService.start(ServeConfig(model_dir, num_slots=2), shared_dir) as service:
        service.url  # OpenAI routes under service.url + "/v1", the RL control plane beside them

The router runs in this process (the driver), as in `belayer-shadow serve`, with the same settings
(`ServeConfig.router_config`); the slots are `SlotHost` actors of a `RolloutCluster`, one
placement-group bundle each, spread over the nodes (`ServeConfig.slot_options`). Weight updates
by folder (`/update_weights {"weight_dir"}`, ...) go to every slot's weight server through its
host (`RemoteSlotWeights`, the router's `WeightLoader`). A lost node's slots are fenced by the
cluster's watcher (their requests resume token-exact on the others) and each is replaced in its
placement-group bundle, which Ray places again on a live node with room; the replacement starts
from the weights last committed and reports the router's version before it serves.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs
import ray
from ray.exceptions import RayError

from belayer_cluster._cluster import NodeLoss, RolloutCluster
from belayer_cluster._errors import BelayerClusterError
from belayer_cluster._slot_host import SlotInfo
from belayer_router import (
    PartialWeightCommitError,
    RouterAdmin,
    RouterApp,
    RouterClientError,
    WeightLoadError,
    running_router,
)
from belayer_shadow import ModelFolder, ServeConfig

__all__ = ["ClusterService", "RemoteSlotWeights"]

_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


@attrs.define(eq=False)
class RemoteSlotWeights:
    """belayer-router's `WeightLoader` over slots on Ray nodes, through their `SlotHost` actors.

    An update is one across every live slot, as belayer-shadow's `SlotWeights` is on one machine:
    every host reads the folder (on storage every node reads), checks it whole against its weight
    server and writes it into the inactive half (`SlotHost.prepare_weights`); any refusal or a
    host that does not answer aborts every one (a 400, the previous weights stay served). Then
    each commits; a commit that fails after others is a `PartialWeightCommitError` naming those
    that did (the router holds the others out). A slot that is out (restarting) keeps the folder
    for its restart. The folder is copied under `shared_dir/weights` for replacement slots.
    """

    shared_dir: Path
    call_timeout_s: float = 300.0
    hosts: dict[str, Any] = attrs.field(factory=dict)  # live slot -> its SlotHost (rebound, not changed)
    # Held through an update and through a replacement's start: a replacement starts from the
    # weights last committed and is written by every later update.
    lock: threading.RLock = attrs.field(factory=threading.RLock)
    current: Path | None = None  # the copy of the weights last committed, None before any update
    num_loads: int = 0
    skipped: list[str] = attrs.field(factory=list)  # the slots the last update skipped (out)

    def add(self, slot: str, host: Any) -> None:
        """Write every later update to `slot` too."""
        self.hosts = {**self.hosts, slot: host}

    def remove(self, slot: str) -> None:
        """Write no later update to `slot` (its node is lost)."""
        self.hosts = {name: host for name, host in self.hosts.items() if name != slot}

    def load_weights(self, weight_dir: str) -> int:
        """Load `weight_dir` into every live slot and commit; the number of tensors written."""
        folder = Path(weight_dir)
        if not folder.is_dir():
            raise WeightLoadError(
                f"weight folder {weight_dir!r} does not exist or is not a folder on the driver; give a "
                "folder of *.safetensors on storage that the driver and every node read"
            )
        with self.lock:
            hosts = dict(self.hosts)
            if not hosts:
                raise WeightLoadError(f"weights from {weight_dir!r} not loaded: no slot serves")
            answers, failed = self._ask(hosts, "prepare_weights", weight_dir)
            if not failed and all(answer["out"] for answer in answers.values()):
                failed["every slot"] = "out (restarting or unhealthy), so none can check them"
            if failed:
                self._abort(hosts, answers)
                reasons = "; ".join(f"{slot}: {why}" for slot, why in failed.items())
                raise WeightLoadError(
                    f"weights from {weight_dir!r} not loaded ({reasons}); the previous ones stay"
                )
            committed: list[str] = []
            tensors, skipped = 0, []
            for slot in answers:
                try:
                    answer = ray.get(hosts[slot].commit_weights.remote(), timeout=self.call_timeout_s)
                    error = str(answer["error"])
                except RayError as exc:
                    error = f"its host did not answer ({type(exc).__name__})"
                if error:
                    self._abort(hosts, {s: a for s, a in answers.items() if s not in committed and s != slot})
                    if committed:
                        self._keep(folder)
                        raise PartialWeightCommitError(
                            f"weights from {weight_dir!r} committed on {committed} only, then {slot} "
                            f"failed ({error}); the other slots still hold the previous weights",
                            tuple(committed),
                        )
                    raise WeightLoadError(f"weights from {weight_dir!r} not loaded ({slot}: {error})")
                committed.append(slot)
                tensors = max(tensors, int(answer["tensors"]))
                if answer["skipped"]:
                    skipped.append(slot)
            self._keep(folder)
            self.num_loads += 1
            self.skipped = skipped
            return tensors

    def _ask(self, hosts: dict[str, Any], method: str, *args: Any) -> tuple[dict[str, Any], dict[str, str]]:
        refs = {slot: getattr(host, method).remote(*args) for slot, host in hosts.items()}
        answers: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for slot, ref in refs.items():
            try:
                answer = ray.get(ref, timeout=self.call_timeout_s)
            except RayError as exc:
                failed[slot] = f"its host did not answer ({type(exc).__name__})"
                continue
            if answer["error"]:
                failed[slot] = str(answer["error"])
            else:
                answers[slot] = answer
        return answers, failed

    def _abort(self, hosts: dict[str, Any], prepared: dict[str, Any]) -> None:
        for slot in prepared:
            with contextlib.suppress(RayError):
                ray.get(hosts[slot].abort_weights.remote(), timeout=self.call_timeout_s)

    def _keep(self, folder: Path) -> None:
        """Copy the committed folder's safetensors to `shared_dir/weights/vN` (a replacement slot
        starts from it) and drop the copy before: a slot started from that one has been written
        or has kept its own copy since."""
        target = self.shared_dir / "weights" / f"v{self.num_loads + 1}"
        aside = target.with_name(target.name + ".new")
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir(parents=True)
        for file in sorted(folder.glob("*.safetensors")):
            shutil.copyfile(file, aside / file.name)
        aside.rename(target)
        previous, self.current = self.current, target
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)


@attrs.define(eq=False)
class ClusterService:
    """A running service: the router in this process, its slots on the Ray cluster."""

    config: ServeConfig
    url: str
    slot_url: str  # the router's URL as the nodes reach it
    app: RouterApp
    admin_token: str
    rollout: RolloutCluster
    weights: RemoteSlotWeights
    replaced: list[tuple[str, SlotInfo]] = attrs.field(factory=list)  # (lost slot, its replacement)
    replace_errors: list[str] = attrs.field(factory=list)
    _closing: threading.Event = attrs.field(factory=threading.Event)
    _threads: list[threading.Thread] = attrs.field(factory=list)
    _generation: dict[str, int] = attrs.field(factory=dict)

    @property
    def openai_base_url(self) -> str:
        """The base URL an OpenAI client takes (`.../v1`)."""
        return self.url + "/v1"

    @property
    def slots(self) -> dict[str, SlotInfo]:
        """Every slot started, lost ones and replacements included: where each runs."""
        return dict(self.rollout.infos)

    @classmethod
    @asynccontextmanager
    async def start(cls, config: ServeConfig, shared_dir: Path) -> AsyncIterator[ClusterService]:
        """Start the router and `config.num_slots` slots on the Ray cluster this process is
        connected to; yield once every slot serves (and its shadow stands by); stop at exit.
        The model folder and `shared_dir` must be readable at the same path on every node."""
        model = ModelFolder.inspect(config.model_dir)  # UnsupportedModelError before anything starts
        admin_token = secrets.token_hex(16)
        router_config = config.router_config(model, admin_token)
        weights = RemoteSlotWeights(Path(shared_dir))
        async with running_router(
            router_config, config.host, config.port, server=config.router_server, weight_loader=weights
        ) as (url, app):
            slot_url = _reachable(url, config.host)
            rollout = RolloutCluster(
                [f"slot{index}" for index in range(config.num_slots)],
                router_url=slot_url,
                shared_dir=Path(shared_dir),
                admin_token=admin_token,
                slot_options=config.slot_options(),
                start_timeout_s=config.start_timeout_s,
            )
            service = cls(config, url, slot_url, app, admin_token, rollout, weights)
            rollout.on_node_loss = service._on_node_loss
            try:
                infos = await anyio.to_thread.run_sync(rollout.start)
                for slot in infos:
                    weights.add(slot, rollout.hosts[slot])
                yield service
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(service._stop)

    def _stop(self) -> None:
        self._closing.set()
        for thread in list(self._threads):  # a replacement being started finishes (or times out)
            thread.join(timeout=self.config.start_timeout_s + 60)
        self.rollout.stop()

    def _on_node_loss(self, loss: NodeLoss) -> None:
        """The watcher's hook: no update goes to the lost slots; each is replaced in a thread."""
        for slot in loss.slots:
            self.weights.remove(slot)
        if self._closing.is_set() or not loss.slots:
            return
        thread = threading.Thread(
            target=self._replace, args=(loss,), name="belayer-cluster-replace", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _replace(self, loss: NodeLoss) -> None:
        for lost in loss.slots:
            if self._closing.is_set():
                return
            base = lost.split("-r", 1)[0]
            self._generation[base] = self._generation.get(base, 0) + 1
            name = f"{base}-r{self._generation[base]}"
            with self.weights.lock:  # no update between the start from `current` and the version report
                weights = self.weights.current or self.config.model_dir
                options = {**self.config.slot_options(), "weights": weights}
                try:
                    info = self.rollout.replace(lost, name, slot_options=options)
                except BelayerClusterError as exc:
                    self.replace_errors.append(str(exc))
                    print(f"belayer-cluster: slot {lost} not replaced: {exc}", file=sys.stderr, flush=True)
                    continue
                self.weights.add(name, self.rollout.hosts[name])
                self._report_version(name)
            self.replaced.append((lost, info))
            print(
                f"belayer-cluster: slot {lost} of lost node {loss.node_id[:12]} replaced by {name} on node "
                f"{info.node_id[:12]}",
                file=sys.stderr,
                flush=True,
            )

    def _report_version(self, slot: str) -> None:
        """A replacement holds the weights last committed: it reports the router's required
        version (if any), and the version gate lets it serve. An update that raced it has given it
        a newer version already (a 409 here, nothing to do)."""
        try:
            with RouterAdmin(self.slot_url, self.admin_token) as admin:
                required = admin.workers().required_version
                if required is not None:
                    admin.report_weight_version(slot, required)
        except RouterClientError as exc:
            if exc.status != 409:
                print(f"belayer-cluster: {slot}'s weight version not reported: {exc}", file=sys.stderr)


def _reachable(url: str, host: str) -> str:
    """The router's URL as the nodes reach it: for a wildcard address, this node's address in
    the Ray cluster (what the nodes see of the driver), else the address it listens on."""
    if host not in _WILDCARD_HOSTS:
        return url
    port = url.rsplit(":", 1)[1]
    address = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    return f"http://{address}:{port}"
