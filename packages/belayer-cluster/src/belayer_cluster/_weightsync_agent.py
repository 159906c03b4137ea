"""`WeightAgent`: the long-lived Ray actor on one node that receives weight versions for it.

It sits beside the node's weight servers (the slots' belayer-gpumem servers, or one of its own on
a node without slots yet), never inside an engine: a main worker killed and replaced by its shadow
leaves the agent, its gloo group and its generation as they were. Each update arrives over a
two-member gloo group with the trainer (rank 0) straight into the first server's inactive slot,
is copied to the node's other servers, checksummed, and committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from belayer_cluster._errors import WeightSyncError
from belayer_cluster._weightsync_pack import checksum, gloo_group, pack, unpack
from belayer_gpumem import BelayerGpumemError, ServerConfig, ServerProcess, WeightClient, WeightLayout

__all__ = ["WeightAgent"]

# The guard of an agent's own weight server: a small process that blocks on a pipe from the agent.
# When the agent ends in any way (SIGKILL from `ray.kill`, its node lost), the kernel closes the
# pipe, the read returns, and the guard stops the server (SIGTERM, SIGKILL after 10 s), which would
# otherwise outlive the agent as an orphan.
_GUARD = """
import os, signal, sys, time
pid = int(sys.argv[1])
sys.stdin.buffer.read()
for sig, grace_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        break
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.1)
"""


class WeightAgent:
    """One node's receiver; `WeightSync` creates it as a Ray actor pinned to the node (0 CPUs)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.generation = 0
        self.version = -1  # the trainer's version last committed here; -1: none yet
        self.checksum = ""
        self._clients: list[WeightClient] = []
        self._sockets: list[str] = []
        self._layout: WeightLayout | None = None
        self._group: Any = None
        self._own_server: ServerProcess | None = None
        self._guard: subprocess.Popen[bytes] | None = None

    def pid(self) -> int:
        """This actor's process id (chaos tests stop or kill it)."""
        return os.getpid()

    def attach(self, sockets: list[str]) -> dict[str, Any]:
        """Add weight servers of this node; returns the table and each one's live checksum.

        Every server must have the same table as those already attached.
        """
        added: list[WeightClient] = []
        try:
            for socket in sockets:
                client = WeightClient.attach(socket)
                added.append(client)
                client.release()  # never pin a version: an update must not wait for the agent
                if self._layout is None:
                    self._layout = client.layout
                elif client.layout != self._layout:
                    raise WeightSyncError(
                        f"the weight server at {socket} on node {self.node_id[:12]} has another table "
                        "than the node's others: every slot must run the same model"
                    )
        except BelayerGpumemError as exc:
            for client in added:
                client.detach()
            raise WeightSyncError(
                f"node {self.node_id[:12]}: cannot attach to a weight server: {exc}"
            ) from exc
        except BaseException:
            for client in added:
                client.detach()
            raise
        self._clients += added
        self._sockets += [str(socket) for socket in sockets]
        assert self._layout is not None
        return {"layout": self._layout.to_json(), "live": self.live()[-len(added) :] if added else []}

    def detach(self, sockets: list[str]) -> int:
        """Forget these weight servers (their slot stopped); returns how many remain."""
        for socket in sockets:
            if str(socket) in self._sockets:
                index = self._sockets.index(str(socket))
                client = self._clients.pop(index)
                self._sockets.pop(index)
                with contextlib.suppress(BelayerGpumemError):
                    client.detach()
        return len(self._clients)

    def serve(self, layout: dict[str, Any], run_dir: str) -> dict[str, Any]:
        """Start a weight server of this agent's own (host memory) for a node without slots yet."""
        folder = Path(run_dir)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        layout_file = folder / "weights-layout.json"
        layout_file.write_text(json.dumps(layout))
        socket = folder / "weights.sock"
        try:
            self._own_server = ServerProcess.start(
                ServerConfig(kind="weights", socket=socket, layout_file=layout_file)
            )
        except BelayerGpumemError as exc:
            raise WeightSyncError(
                f"node {self.node_id[:12]}: its own weight server did not start: {exc}"
            ) from exc
        # the server ends with this agent, however the agent ends (see _GUARD)
        self._guard = subprocess.Popen(
            [sys.executable, "-c", _GUARD, str(self._own_server.pid)], stdin=subprocess.PIPE
        )
        return self.attach([str(socket)])

    def connect(self, generation: int, host: str, port: int, timeout_s: float) -> int:
        """Join the trainer's fresh rendezvous at `host:port` as rank 1 of a two-member gloo group."""
        self._group = None
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, 2, False, timeout=timeout)  # type: ignore[attr-defined]
        import ray

        address = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self._group = gloo_group(store, 1, timeout, address)
        self.generation = generation
        return generation

    def receive(
        self, generation: int, version: int, chunk_bytes: int, timeout_s: float, expected: str = ""
    ) -> dict[str, Any]:
        """Receive version `version` into every server's inactive slot, checksum it, commit it.

        Every server's inactive slot is checksummed before anything is committed; with `expected`
        (the trainer's checksum) a slot that differs is never committed. Returns `{node_id,
        generation, version, checksum, server_versions, pid}`. On any failure the open updates are
        aborted (readers keep the old version) and the group is dropped.
        """
        if self._group is None or generation != self.generation:
            raise WeightSyncError(f"node {self.node_id[:12]} is not in group generation {generation}")
        if not self._clients or self._layout is None:
            raise WeightSyncError(f"node {self.node_id[:12]} has no weight server attached")
        slot_bytes = self._layout.slot_bytes
        updates: list[Any] = []
        # a server whose slot stopped or died is forgotten; the node fails only with none left
        for socket, client in list(zip(self._sockets, self._clients, strict=True)):
            try:
                client.latest_version()
            except BelayerGpumemError:
                self.detach([socket])
        if not self._clients:
            raise WeightSyncError(f"node {self.node_id[:12]}: every weight server of it is gone")
        try:
            for client in self._clients:
                updates.append(client.update(timeout_s=timeout_s))
            first = self._clients[0].region[updates[0].slot_offset : updates[0].slot_offset + slot_bytes]
            options = dist.BroadcastOptions()
            options.rootRank = 0
            for start in range(0, slot_bytes, chunk_bytes):
                self._group.broadcast([first[start : start + chunk_bytes]], options).wait()
            received = checksum(first)
            if expected and received != expected:
                raise WeightSyncError(
                    f"received {received}, the trainer sent {expected}: not committed, the weight "
                    "servers keep their live version"
                )
            for socket, client, update in zip(self._sockets[1:], self._clients[1:], updates[1:], strict=True):
                copy = client.region[update.slot_offset : update.slot_offset + slot_bytes]
                copy.copy_(first)
                if checksum(copy) != received:
                    raise WeightSyncError(
                        f"the copy into the weight server at {socket} differs: not committed"
                    )
            server_versions = [int(update.commit()) for update in updates]
        except BaseException as exc:
            for update in updates:
                if not update.done:
                    with contextlib.suppress(BelayerGpumemError):  # the server is gone: nothing to abort
                        update.abort()
            self._group = None  # a failed collective leaves the pair unusable: a new rendezvous mends it
            if isinstance(exc, WeightSyncError | BelayerGpumemError | RuntimeError):
                raise WeightSyncError(
                    f"node {self.node_id[:12]}: receiving version {version} failed: {exc}"
                ) from exc
            raise
        finally:
            for client in self._clients:
                with contextlib.suppress(BelayerGpumemError):
                    client.release()
        self.version, self.checksum = version, received
        return self.status() | {"server_versions": server_versions}

    def live(self) -> list[dict[str, Any]]:
        """Each attached server's committed version and the checksum of its live slot (read back)."""
        found: list[dict[str, Any]] = []
        assert self._layout is not None or not self._clients
        for client in self._clients:
            client.refresh()
            try:
                assert self._layout is not None
                found.append(
                    {
                        "server_version": client.version,
                        "checksum": checksum(pack(client.tensors(), self._layout)),
                    }
                )
            finally:
                client.release()
        return found

    def status(self) -> dict[str, Any]:
        """`{node_id, generation, version, checksum, pid, num_servers, own_server_pid}` of this node."""
        return {
            "node_id": self.node_id,
            "generation": self.generation,
            "version": self.version,
            "checksum": self.checksum,
            "pid": os.getpid(),
            "num_servers": len(self._clients),
            "own_server_pid": None if self._own_server is None else self._own_server.pid,
        }

    def save_safetensors(self, path: str) -> str:
        """Write the first server's live version to `path` (a new slot's `weights`); returns its checksum."""
        if not self._clients or self._layout is None:
            raise WeightSyncError(f"node {self.node_id[:12]} has no weight server to save from")
        from belayer_shadow import save_safetensors

        client = self._clients[0]
        client.refresh()
        try:
            flat = pack(client.tensors(), self._layout)
        finally:
            client.release()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(unpack(flat, self._layout), path)
        return checksum(flat)

    def close(self) -> None:
        """Leave the group, detach from the servers, stop this agent's own server (if any)."""
        self._group = None
        for client in self._clients:
            with contextlib.suppress(BelayerGpumemError):
                client.detach()
        self._clients.clear()
        if self._guard is not None:  # an orderly close stops the server itself
            self._guard.kill()
            self._guard.wait()
            self._guard = None
        if self._own_server is not None:
            self._own_server.stop(timeout_s=10)
            self._own_server = None
