"""`IsolatedRayCluster`: a local Ray cluster whose nodes share nothing but the network and one folder.

Each node is a set of Linux namespaces of its own (needs root):

- network: its own namespace, one veth into a bridge of the cluster, its own address
  (`10.A.B.k/24`; the bridge, on the host, is `.1`: the head, the driver and its router listen there);
- PID (its init, `belayer_cluster._node_init`, is PID 1: a SIGKILL of it ends every process of the
  node at once), IPC, UTS (its hostname is its name) and mount;
- a private tmpfs on /tmp and /dev/shm (Ray's sockets, object store and session folder are the
  node's own), the one shared folder bound in at its own path (checkpoints, the router journal, run
  folders) and the project's Python environment read-only;
- its own raylet: `ray start --address HEAD --node-ip-address IP --block` inside it.

One view of the host stays: its /proc, read-only at `HOST_PROC` inside the node, where the node's
sandbox host reads the processes of the containers it owns (the Docker daemon and its containers
are the host's; `BELAYER_ENVCKPT_HOST_PROC`). Signals cannot cross PID namespaces by pid: a node
cannot kill a container's process by its host pid (belayer-envckpt then sends nothing).

The head (GCS, no CPUs) runs on the host, on the bridge's address. The Docker daemon is the host's,
shared: a node owns the containers labelled `belayer.node=<its name>` (its sandbox host puts the
label on every sandbox, read from `BELAYER_NODE` in the node's environment); when the node ends
(killed, its raylet fenced after a partition, or shut down) this runtime removes them.

Faults: `remove_node` / `kill_node` (the whole node, as a lost machine), `cut` / `heal` /
`partition` (its veth down, then up: the node keeps running, cut off; Ray fences it as dead after its
health checks, and a raylet that was declared dead exits when it hears so).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import ray

from belayer_cluster._config import LocalClusterConfig
from belayer_cluster._errors import ClusterConfigError, ClusterStartError
from belayer_cluster._ray_head import _session_members
from belayer_cluster._sandbox_host import NODE_ENV, NODE_LABEL

__all__ = ["IsolatedNode", "IsolatedRayCluster", "clean_stale_clusters"]

# The host's /proc inside a node (read-only; in the node's private /tmp): where the node's sandbox
# host reads the processes of the containers it owns (belayer-envckpt's BELAYER_ENVCKPT_HOST_PROC).
HOST_PROC = "/tmp/belayer-host-proc"
# What `ray start` says when its raylet did not register within its fixed 30 s (a loaded machine):
# such a node is started again, up to _NODE_STARTS times in all, within start_timeout_s.
_RAYLET_SLOW = "The current node timed out during startup"
_NODE_STARTS = 3
_STATE_DIR = Path("/run/belayer-isolated")  # one JSON per running cluster: what to clean if its owner died


@attrs.frozen
class IsolatedNode:
    """One node: its name (hostname, Docker label), Ray id, address, namespace, veth and init pid."""

    name: str
    node_id: str
    ip: str
    netns: str
    veth: str  # the host side of its link (down: partitioned)
    pid: int  # its init (PID 1 inside), seen from the host
    started_s: float  # `ray start` to Ray listing the node alive

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return attrs.asdict(self)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise ClusterStartError(f"`{' '.join(argv)}` failed: {result.stderr.strip()[:300]}")
    return result


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _child_of(pid: int, timeout_s: float) -> int:
    """The one child of `pid` (unshare's forked init), waited for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.02)
    raise ClusterStartError(f"the node's init did not start under pid {pid} within {timeout_s} s")


def _used_subnets() -> set[str]:
    found = set()
    for line in _run("ip", "-4", "-o", "addr").stdout.splitlines():
        for word in line.split():
            if "/" in word and word[0].isdigit():
                found.add(str(ipaddress.ip_interface(word).network))
    return found


def _read_only_paths() -> list[str]:
    """The project's Python environment: the interpreter's prefixes and every folder on sys.path."""
    paths = {sys.prefix, sys.base_prefix, *(p for p in sys.path if p)}
    return sorted(p for p in paths if os.path.isdir(p) and p != "/")


def clean_stale_clusters() -> list[str]:
    """Remove what isolated clusters whose owner process died left (their nodes' inits and the
    head, namespaces, veths, bridges, rules, the head's folder); the ids of those clusters.

    A new cluster calls it before it starts; a guardian that outlives the owner (belayer-grpo's
    after a SIGKILL of its trainer) calls it once the owner is dead."""
    cleaned = []
    for state_file in sorted(_STATE_DIR.glob("*.json")) if _STATE_DIR.is_dir() else []:
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(state.get("owner", 0))):
            continue
        for pid in state.get("pids", []):
            if _ours(int(pid), str(state["id"]), state.get("netns", [])):  # never a reused pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
        # A session id is not given to a new process while members of that session live: these
        # are the head's own (a `ray::DashboardAgent` outlived a SIGKILLed trainer here).
        for pid in _session_members(int(state.get("head_session", 0))) if state.get("head_session") else []:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _teardown_network(state["id"], state.get("netns", []), state.get("bridge", ""))
        for temp in Path("/tmp").glob(f"bli{state['id']}-*"):  # the head's folder (`_start_head`)
            shutil.rmtree(temp, ignore_errors=True)
        with contextlib.suppress(OSError):
            state_file.unlink()
        cleaned.append(str(state["id"]))
    return cleaned


def _ours(pid: int, cluster_id: str, netns: Sequence[str]) -> bool:
    """True when `pid` is still a process of that cluster: in one of its nodes' network namespaces,
    or its head (`ray start` with the cluster's temp folder on its command line)."""
    try:
        own = os.stat(f"/proc/{pid}/ns/net").st_ino
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    for name in netns:
        with contextlib.suppress(OSError):
            if os.stat(f"/run/netns/{name}").st_ino == own:
                return True
    return f"/bli{cluster_id}-".encode() in cmdline


def _forward_rule(bridge: str) -> list[str]:
    # Docker sets the FORWARD policy to DROP and bridged packets pass iptables (br_netfilter):
    # node-to-node traffic on the cluster's bridge is let through by this one rule.
    return ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def _teardown_network(cluster_id: str, netns: Sequence[str], bridge: str) -> None:
    for name in netns:
        _run("ip", "netns", "delete", name, check=False)
    if bridge:
        if shutil.which("iptables"):
            while _run("iptables", "-D", *_forward_rule(bridge), check=False).returncode == 0:
                pass
        _run("ip", "link", "delete", bridge, check=False)
    for line in _run("ip", "-o", "link", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"blv{cluster_id}"):
            _run("ip", "link", "delete", name, check=False)


class _Node:
    """A running node's handles (the public view is `IsolatedNode`)."""

    def __init__(self, name: str, index: int, ip: str, netns: str, veth: str) -> None:
        self.name, self.index, self.ip, self.netns, self.veth = name, index, ip, netns, veth
        self.process: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.node_id = ""
        self.started_s = 0.0
        self.log = Path()
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.starts = 0
        self.stale_ids: set[str] = set()  # Ray node ids of this address's earlier, failed starts

    def public(self) -> IsolatedNode:
        return IsolatedNode(self.name, self.node_id, self.ip, self.netns, self.veth, self.pid, self.started_s)


class IsolatedRayCluster:
    """A head on this host and `config.num_nodes` nodes that share nothing but the network and
    `shared_dir` (see the module's docstring). Same use as `LocalRayCluster`: a context manager, or
    `start` / `shutdown`; this process is connected to it as the driver.

    `read_only` are the folders a node sees read-only (default: the interpreter's prefixes and every
    folder on `sys.path`, i.e. the project's Python environment); everything else of the host's
    filesystem is visible too (no image of its own) but /tmp and /dev/shm are the node's own.
    `startup_s` says how long the start took: `head`, `nodes` (all in parallel) and `total`.
    """

    def __init__(
        self,
        config: LocalClusterConfig | None = None,
        *,
        shared_dir: Path,
        read_only: Sequence[Path] | None = None,
        start_timeout_s: float = 180.0,
    ) -> None:
        if os.geteuid() != 0:
            raise ClusterConfigError("IsolatedRayCluster needs root (network and mount namespaces)")
        for tool in ("ip", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise ClusterConfigError(f"IsolatedRayCluster needs `{tool}` on PATH (iproute2, util-linux)")
        self.config = config or LocalClusterConfig()
        self.shared_dir = Path(shared_dir).resolve()
        self.read_only = [str(p) for p in read_only] if read_only is not None else _read_only_paths()
        self.start_timeout_s = start_timeout_s
        self.id = f"{random.getrandbits(20):05x}"
        self.bridge = f"blb{self.id}"
        self.head_ip = ""
        self.port = 0
        self.startup_s: dict[str, float] = {}
        self._network: ipaddress.IPv4Network | None = None
        self._head: subprocess.Popen[bytes] | None = None
        self._temp: Path | None = None
        self._nodes: dict[str, _Node] = {}  # node id -> node, in start order
        self._gone: dict[str, _Node] = {}  # removed or ended nodes
        self._removed: list[str] = []
        self._moved: dict[str, str] = {}  # a moving service address -> the node that has it
        self._next_index = 2
        self._lock = threading.RLock()
        self._started = False

    # ---- what callers read -------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address (`ray.init(address=...)`), on the bridge."""
        if not self._started:
            raise ClusterStartError("the IsolatedRayCluster is not started; call start() first")
        return f"{self.head_ip}:{self.port}"

    @property
    def node_ids(self) -> list[str]:
        """The nodes still in the cluster, in start order (hex ids)."""
        return list(self._nodes)

    @property
    def removed_node_ids(self) -> list[str]:
        """The nodes removed through `remove_node` / `kill_node`, in order."""
        return list(self._removed)

    @property
    def nodes(self) -> dict[str, IsolatedNode]:
        """Every node started, still running or not, by Ray id."""
        return {n.node_id: n.public() for n in [*self._nodes.values(), *self._gone.values()]}

    def node(self, node_id: str) -> IsolatedNode:
        """One node by Ray id (also a removed one)."""
        found = self._nodes.get(node_id) or self._gone.get(node_id)
        if found is None:
            raise ClusterConfigError(f"no node {node_id[:12]} in this cluster")
        return found.public()

    def node_running(self, node_id: str) -> bool:
        """True while the node's init (hence every process of it) still runs."""
        found = self._nodes.get(node_id) or self._gone.get(node_id)
        return found is not None and found.pid > 0 and _alive(found.pid)

    def node_processes(self, node_id: str) -> list[int]:
        """Host pids of every process of the node (its PID namespace)."""
        found = self._nodes.get(node_id) or self._gone.get(node_id)
        if found is None or not _alive(found.pid):
            return []
        target = os.readlink(f"/proc/{found.pid}/ns/pid")
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "pid") == target:
                        pids.append(int(entry.name))
        return pids

    def host_pid(self, node_id: str, pid: int) -> int:
        """The host's pid of the node's process `pid` (a pid a process of the node reports, e.g.
        `os.getpid()` in an actor, is its PID namespace's); 0 if the node runs no such process."""
        for host in self.node_processes(node_id):
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in Path(f"/proc/{host}/status").read_text().splitlines():
                    if line.startswith("NSpid:") and int(line.split()[-1]) == pid:
                        return host
        return 0

    def raylet_pid(self, node_id: str) -> int:
        """The host's pid of the node's raylet (every Ray worker of the node is its child)."""
        for host in self.node_processes(node_id):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{host}/comm").read_text().strip() == "raylet":
                    return host
        raise ClusterConfigError(f"node {node_id[:12]} runs no raylet")

    def launcher(self, node_id: str) -> list[str]:
        """The command prefix that runs a command as a process of the node: in its network, PID,
        IPC, UTS and mount namespaces (`nsenter`; e.g. `DriverRouter(launcher=...)`). Such a
        process ends with the node (`kill_node`)."""
        node = self._running(node_id)
        return ["nsenter", "-t", str(node.pid), "--net", "--pid", "--ipc", "--uts", "--mount", "--"]

    def free_address(self) -> str:
        """An address of the cluster's subnet that no node has (for a service that moves between
        nodes, `move_address`), from the top of the range down."""
        assert self._network is not None
        taken = {n.ip for n in [*self._nodes.values(), *self._gone.values()]} | set(self._moved)
        for offset in range(250, 1, -1):
            candidate = str(self._network.network_address + offset)
            if candidate not in taken:
                return candidate
        raise ClusterStartError("no free address left in the cluster's subnet")

    def move_address(self, address: str, node_id: str) -> None:
        """Give `address` to the node (a second address on its link), taken from the node that had
        it if it still runs; the host's and every node's neighbour entry for it are flushed, so the
        next packet finds its new owner (as a floating service address fails over)."""
        node = self._running(node_id)
        old = self._moved.get(address)
        if old is not None and old in self._nodes:
            _run(
                "ip", "-n", self._nodes[old].netns, "addr", "del", f"{address}/24", "dev", "eth0", check=False
            )
        _run("ip", "-n", node.netns, "addr", "add", f"{address}/24", "dev", "eth0")
        self._moved[address] = node_id
        _run("ip", "neigh", "flush", "to", address, check=False)
        for other in self._nodes.values():
            _run("ip", "-n", other.netns, "neigh", "flush", "to", address, check=False)

    def containers(self, node_id: str) -> list[str]:
        """The Docker containers the node owns (label `belayer.node=<its name>`)."""
        from belayer_envckpt import Engine

        found = self._nodes.get(node_id) or self._gone.get(node_id)
        if found is None:
            raise ClusterConfigError(f"no node {node_id[:12]} in this cluster")
        with Engine.connect() as engine:
            return [c.id for c in engine.list_containers([f"{NODE_LABEL}={found.name}"])]

    # ---- start and stop --------------------------------------------------------------------------

    def start(self) -> IsolatedRayCluster:
        """Network, head, then every node in parallel; wait until Ray lists them all; connect."""
        if self._started:
            raise ClusterStartError("this IsolatedRayCluster is already started; call shutdown() first")
        if ray.is_initialized():
            raise ClusterStartError("this process is already connected to Ray; call ray.shutdown() first")
        began = time.monotonic()
        clean_stale_clusters()
        self._started = True
        try:
            self._start_network()
            self._start_head()
            self.startup_s["head"] = round(time.monotonic() - began, 2)
            nodes_began = time.monotonic()
            pending = [self._launch(self.config.cpus_per_node, {}) for _ in range(self.config.num_nodes)]
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
            for node in pending:
                self._await(node)
            self.startup_s["nodes"] = round(time.monotonic() - nodes_began, 2)
            self.startup_s["total"] = round(time.monotonic() - began, 2)
        except Exception as exc:  # ray and the tools fail in many ways while starting
            self.shutdown()
            if isinstance(exc, ClusterStartError):
                raise
            raise ClusterStartError(f"could not start the isolated cluster: {exc}") from exc
        return self

    def add_node(self, num_cpus: float | None = None, resources: dict[str, float] | None = None) -> str:
        """Start one more node (a replacement machine) and wait until Ray lists it; its node id."""
        node = self._launch(self.config.cpus_per_node if num_cpus is None else num_cpus, resources or {})
        return self._await(node)

    def shutdown(self) -> None:
        """Disconnect; stop every node (then kill what is left), the head and the network; remove
        the nodes' containers, the head's folder and the cleanup record."""
        if ray.is_initialized():
            ray.shutdown()
        with self._lock:
            nodes = [*self._nodes.values(), *self._gone.values()]
        for node in nodes:
            if node.pid and _alive(node.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        while any(n.pid and _alive(n.pid) for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for node in nodes:
            self._end(node)
        if self._head is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._head.pid, signal.SIGTERM)
            try:
                self._head.wait(timeout=15.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._head.pid, signal.SIGKILL)
                self._head.wait(timeout=15.0)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._head.pid, signal.SIGKILL)  # what `ray start` left in its group
            self._head = None
        if self._started:
            _teardown_network(self.id, [n.netns for n in nodes], self.bridge)
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None
        with contextlib.suppress(OSError):
            (_STATE_DIR / f"{self.id}.json").unlink()
        self._nodes.clear()
        self._gone.clear()
        self._removed.clear()
        self._started = False

    def __enter__(self) -> IsolatedRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- faults ------------------------------------------------------------------------------------

    def kill_node(self, node_id: str) -> float:
        """Lose a node whole: SIGKILL its init, so every process of it ends at once (the kernel
        ends a PID namespace with its init); its link and its containers go. Returns the
        `time.time()` of the kill. Ray declares it dead after its health checks."""
        with self._lock:
            node = self._nodes.pop(node_id, None)
            if node is None:
                raise ClusterConfigError(f"no running node {node_id[:12]} in this cluster")
            self._gone[node_id] = node
            self._removed.append(node_id)
        at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        self._end(node)
        return at

    def remove_node(self, node_id: str) -> None:
        """`kill_node` under `LocalRayCluster`'s name (callers use either cluster alike)."""
        self.kill_node(node_id)

    def cut(self, node_id: str) -> float:
        """Partition a node: its link goes down (the node runs on, cut off). `time.time()` of the cut."""
        node = self._running(node_id)
        _run("ip", "link", "set", node.veth, "down")
        return time.time()

    def heal(self, node_id: str) -> float:
        """Restore a partitioned node's link. A node Ray declared dead meanwhile stays fenced: its
        raylet exits when it hears so and the node ends (`node_running` turns False; its containers
        are removed then). `time.time()` of the heal."""
        node = self._nodes.get(node_id) or self._gone.get(node_id)
        if node is None:
            raise ClusterConfigError(f"no node {node_id[:12]} in this cluster")
        _run("ip", "link", "set", node.veth, "up", check=False)  # gone with its node: nothing to heal
        return time.time()

    def partition(self, node_id: str, seconds: float) -> tuple[float, float]:
        """`cut`, `seconds` later `heal`: (cut, heal) times. Blocks for `seconds`."""
        if seconds < 0:
            raise ClusterConfigError(f"seconds must be >= 0 (got {seconds!r})")
        cut = self.cut(node_id)
        time.sleep(seconds)
        return cut, self.heal(node_id)

    def forget(self, node_id: str) -> None:
        """Count a node that ended by itself (fenced after a partition) as removed: its init is
        killed if it still runs, its containers and link go."""
        with self._lock:
            node = self._nodes.pop(node_id, None)
            if node is None:
                return
            self._gone[node_id] = node
            self._removed.append(node_id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        self._end(node)

    # ---- inside --------------------------------------------------------------------------------------

    def _running(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise ClusterConfigError(f"no running node {node_id[:12]} in this cluster")
        return node

    def _start_network(self) -> None:
        used = _used_subnets()
        for _ in range(200):
            network = ipaddress.IPv4Network(f"10.{random.randint(200, 249)}.{random.randint(0, 255)}.0/24")
            if str(network) not in used:
                break
        else:
            raise ClusterStartError("no free 10.200-249.x.0/24 subnet for the cluster's bridge")
        self._network = network
        self.head_ip = str(network.network_address + 1)
        _STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._save_state()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        if shutil.which("iptables"):
            _run("iptables", "-I", *_forward_rule(self.bridge)[:1], "1", *_forward_rule(self.bridge)[1:])

    def _save_state(self) -> None:
        state = {
            "id": self.id,
            "owner": os.getpid(),
            "bridge": self.bridge,
            "netns": [n.netns for n in [*self._nodes.values(), *self._gone.values()]],
            "pids": [n.pid for n in self._nodes.values() if n.pid]
            + ([self._head.pid] if self._head is not None else []),
            # The head's session (`start_new_session`): its GCS, raylet and Ray's agents, which do
            # not die with `ray start` and not all of which carry their owner's environment.
            "head_session": self._head.pid if self._head is not None else 0,
        }
        (_STATE_DIR / f"{self.id}.json").write_text(json.dumps(state))

    def _start_head(self) -> None:
        self._temp = Path(tempfile.mkdtemp(prefix=f"bli{self.id}-", dir="/tmp"))
        with socket.socket() as sock:
            sock.bind((self.head_ip, 0))
            self.port = int(sock.getsockname()[1])
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
        argv += ["--port", str(self.port), "--node-ip-address", self.head_ip, "--num-cpus", "0"]
        argv += ["--object-store-memory", str(self.config.object_store_bytes), "--temp-dir", str(self._temp)]
        argv += ["--include-dashboard", "false", "--disable-usage-stats"]
        env = dict(os.environ)
        for key, value in self.config.system_config().items():
            env[f"RAY_{key}"] = str(value)  # Ray reads its system config from RAY_<name>
        log = open(self._temp / "head.log", "wb")  # noqa: SIM115 - the child owns it
        with log:
            self._head = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._save_state()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._head.poll() is not None:
                tail = (self._temp / "head.log").read_text(errors="replace")[-1500:]
                raise ClusterStartError(f"`ray start --head` exited: {tail}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.head_ip, self.port), timeout=1.0),
            ):
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"the head did not listen on {self.address} within {self.start_timeout_s} s"
                )
            time.sleep(0.1)

    def _launch(self, num_cpus: float, resources: dict[str, float]) -> _Node:
        assert self._network is not None
        assert self._temp is not None
        with self._lock:
            index = self._next_index
            self._next_index += 1
        if index > 254:
            raise ClusterStartError("a cluster has at most 253 nodes over its life")
        name = f"bl{self.id}-n{index - 1}"
        ip = str(self._network.network_address + index)
        netns, veth, peer = f"bln{self.id}-{index}", f"blv{self.id}{index:02x}", f"blp{self.id}{index:02x}"
        node = _Node(name, index, ip, netns, veth)
        with self._lock:
            self._gone[f"starting-{index}"] = node  # torn down with the others if the start fails
            self._save_state_with(node)
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", netns)
        _run("ip", "-n", netns, "link", "set", peer, "name", "eth0")
        _run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        ray_start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
        ray_start += ["--address", self.address, "--node-ip-address", ip, "--num-cpus", str(num_cpus)]
        ray_start += ["--object-store-memory", str(self.config.object_store_bytes)]
        if resources:
            ray_start += ["--resources", json.dumps(resources)]
        init = [sys.executable, "-m", "belayer_cluster._node_init", "--hostname", name]
        init += ["--shared", str(self.shared_dir)]
        for path in self.read_only:
            init += ["--ro", path]
        init += ["--host-proc", HOST_PROC]
        # nsenter, not `ip netns exec`: that one mounts a sysfs of its own over /sys, hiding the
        # host's cgroups (a container's limits and processes are read there).
        argv = ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--pid", "--ipc", "--mount", "--uts"]
        argv += ["--fork", "--kill-child", *init, "--", *ray_start]
        env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "RAY_ADDRESS")}
        env[NODE_ENV] = name
        env["BELAYER_ENVCKPT_HOST_PROC"] = HOST_PROC
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        node.log = self._temp / f"{name}.log"
        node.argv, node.env = argv, env
        node.started_s = time.monotonic()
        self._spawn(node)
        return node

    def _spawn(self, node: _Node) -> None:
        """Start (or start again) the node's init and its `ray start` in the node's namespaces."""
        node.starts += 1
        with open(node.log, "ab") as log:
            node.process = subprocess.Popen(
                node.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=node.env,
                start_new_session=True,
            )
        node.pid = _child_of(node.process.pid, 30.0)
        # The node's containers die with it, however it ends (killed, fenced, stopped).
        threading.Thread(target=self._watch, args=(node,), name=f"watch-{node.name}", daemon=True).start()
        with self._lock:
            self._save_state_with(node)

    def _save_state_with(self, node: _Node) -> None:
        state = json.loads((_STATE_DIR / f"{self.id}.json").read_text())
        state["netns"] = sorted({*state["netns"], node.netns})
        state["pids"] = sorted({*state["pids"], *([node.pid] if node.pid else [])})
        (_STATE_DIR / f"{self.id}.json").write_text(json.dumps(state))

    def _await(self, node: _Node) -> str:
        began, deadline = node.started_s, node.started_s + self.start_timeout_s
        while True:
            for entry in ray.nodes():  # type: ignore[no-untyped-call]
                if (
                    entry.get("Alive")
                    and entry.get("NodeManagerAddress") == node.ip
                    and str(entry["NodeID"]) not in node.stale_ids
                ):
                    node.node_id = str(entry["NodeID"])
                    node.started_s = round(time.monotonic() - began, 2)
                    with self._lock:
                        self._gone.pop(f"starting-{node.index}", None)
                        self._nodes[node.node_id] = node
                    return node.node_id
            exited = node.process is not None and node.process.poll() is not None
            if exited or time.monotonic() > deadline:
                tail = node.log.read_text(errors="replace")[-1500:] if node.log.exists() else ""
                if (
                    exited
                    and _RAYLET_SLOW in tail
                    and node.starts < _NODE_STARTS
                    and time.monotonic() < deadline
                ):
                    # `ray start` gives its raylet a fixed 30 s to register with the GCS; on a loaded
                    # machine that can pass. The node's init ended every process of that try with it.
                    node.stale_ids |= {
                        str(e["NodeID"])
                        for e in ray.nodes()  # type: ignore[no-untyped-call]
                        if e.get("NodeManagerAddress") == node.ip
                    }
                    self._spawn(node)
                    continue
                raise ClusterStartError(
                    f"node {node.name} ({node.ip}) did not join the cluster ({node.starts} starts): {tail}"
                )
            time.sleep(0.1)

    def _watch(self, node: _Node) -> None:
        if node.process is not None:
            node.process.wait()
            self._reap_containers(node.name)

    def _end(self, node: _Node) -> None:
        """After a node's init is gone (or killed now): wait for it, remove its containers and link."""
        with contextlib.suppress(ProcessLookupError):
            if node.pid and _alive(node.pid):
                os.kill(node.pid, signal.SIGKILL)
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=15.0)
        self._reap_containers(node.name)
        _run("ip", "link", "delete", node.veth, check=False)
        _run("ip", "netns", "delete", node.netns, check=False)

    def _reap_containers(self, name: str) -> None:
        from belayer_envckpt import BelayerEnvckptError, Engine

        try:
            with Engine.connect() as engine:
                for container in engine.list_containers([f"{NODE_LABEL}={name}"]):
                    with contextlib.suppress(BelayerEnvckptError):
                        engine.remove(container.id)
        except BelayerEnvckptError:
            pass  # no Docker daemon here: a node without sandboxes owns none
