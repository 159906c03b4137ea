"""A client process for the tests: `python worker.py COMMAND SOCKET [ARGS]`.

Commands print one result line and exit 0 (or keep running, for `hold`).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from belayer_gpumem import KVClient, ServerGoneError, WeightClient


def _synchronize() -> None:
    # Kernels are asynchronous: a worker that prints "done" or exits must have its writes landed.
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    parts = [f"{name}:{float(t.double().sum()):.6f}" for name, t in sorted(tensors.items())]
    return ";".join(parts)


def main(command: str, socket: str, *args: str) -> None:
    if command == "weights-checksum":
        with WeightClient.attach(socket) as client:
            print(f"VERSION {client.version}")
            print(f"CHECKSUM {_checksum(client.tensors())}")
    elif command == "weights-fill":  # fill every tensor with one value through an update
        value = float(args[0])
        with WeightClient.attach(socket) as client, client.update() as update:
            for tensor in update.tensors().values():
                tensor.fill_(value)
        _synchronize()
        print("DONE")
    elif command == "weights-write-hold":  # write through an update, then hold the mapping until killed
        client = WeightClient.attach(socket)
        with client.update(copy_current=True) as update:
            update.tensors()["layers.0.attn.q_proj.weight"].fill_(float(args[0]))
        print(f"HOLDING {client.version}", flush=True)
        time.sleep(3600)
    elif command == "weights-begin-die":  # open an update, write half of it, die without committing
        client = WeightClient.attach(socket)
        update = client.update()
        next(iter(update.tensors().values())).fill_(-1.0)
        _synchronize()
        print("DYING", flush=True)
        os._exit(9)
    elif command == "weights-hammer-write":
        rounds = int(args[0])
        with WeightClient.attach(socket) as client:
            for value in range(1, rounds + 1):
                with client.update(timeout_s=60) as update:
                    for tensor in update.tensors().values():
                        tensor.fill_(float(value))
        _synchronize()
        print("DONE")
    elif command == "weights-hammer-read":
        _hammer_read(socket, int(args[0]))
    elif command == "kv-write":  # write a value into one block of every layer, K and V
        block, value = int(args[0]), float(args[1])
        with KVClient.attach(socket) as kv:
            kv.arena[:, :, block].fill_(value)
            _synchronize()
            print(f"GENERATION {kv.generation}")
    elif command == "kv-read":
        block = int(args[0])
        with KVClient.attach(socket) as kv:
            print(f"BLOCK {float(kv.arena[:, :, block].double().sum())} GENERATION {kv.generation}")
    elif command == "ping-after-server-death":
        client = WeightClient.attach(socket)
        print("ATTACHED", flush=True)
        if not sys.stdin.readline():  # the test kills the server, then writes a line
            raise SystemExit("stdin closed before the go line")
        before = _checksum(client.tensors())
        try:
            client.ping()
        except ServerGoneError as exc:
            print(f"GONE {type(exc).__name__}")
        print(f"STILL-READABLE {before == _checksum(client.tensors())}")
    else:
        raise SystemExit(f"unknown command {command}")


def _hammer_read(socket: str, final_version: int) -> None:
    """Read until `final_version` shows up; every read must show exactly its version's value (never torn)."""
    torn = reads = 0
    versions: set[int] = set()
    with WeightClient.attach(socket) as client:
        print("ATTACHED", flush=True)  # pinned now: the writer cannot get two versions ahead of us
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            client.refresh()
            values = {v for t in client.tensors().values() for v in t.float().unique().tolist()}
            torn += values != {float(client.version)}
            versions.add(client.version)
            reads += 1
            if client.version >= final_version:
                break
    print(f"READS {reads} TORN {torn} VERSIONS {len(versions)} LAST {max(versions)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
