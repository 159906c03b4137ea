"""`belayer-envckpt`: doctor, checkpoint, restore, ls, verify, gc and a demo."""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

from ._checkpoint import full_checkpoint, full_restore
from ._criu import check_criu, doctor_checks
from ._demo import run_demo
from ._docker import Engine
from ._errors import (
    BelayerEnvckptError,
    CheckpointNotFoundError,
    ContainerNotFoundError,
    InvalidConfigError,
    InvalidIdError,
)
from ._kinds import checkpoint
from ._limits import SandboxLimits, engine_warnings
from ._restore_engine import restore_engine_line
from ._sandbox import Sandbox, SandboxConfig
from ._store import Checkpoint, CheckpointStore


class ExitCode(enum.IntEnum):
    """The exit codes every Belayer command shares (root README, "One CLI contract")."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNHEALTHY = 3
    INTERRUPTED = 130


Command = Callable[[argparse.Namespace], tuple[dict[str, Any], int]]
DEFAULT_IMAGES = ("belayer/busybox:latest", "belayer/debian-python:latest")


def _summary(c: Checkpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": c.checkpoint_id,
        "kind": c.kind,
        "artifacts_of": c.artifacts_of,
        "trajectory": c.trajectory,
        "prefix": c.prefix,
        "context_ref": c.context_ref,
        "image": c.image,
        "bytes": c.total_bytes,
        "freeze_ms": c.timings_ms.get("freeze_ms"),
        "total_ms": c.timings_ms.get("total_ms"),
        "path": str(c.path),
    }


def _doctor(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    checks: dict[str, dict[str, Any]] = {}
    engine: Engine | None = None
    try:
        engine = Engine.connect()
        checks["engine"] = {"ok": True, "detail": engine.version()}
    except BelayerEnvckptError as exc:
        checks["engine"] = {"ok": False, "detail": str(exc)}
    if engine is not None:
        ok = engine.experimental()
        checks["experimental"] = {
            "ok": ok,
            "detail": "on"
            if ok
            else 'off: put {"experimental": true} in /etc/docker/daemon.json, restart dockerd',
        }
    try:
        said = check_criu().splitlines()
        checks["criu"] = {
            "ok": True,
            "detail": next((line for line in said if "Looks good" in line), said[-1]),
        }
    except BelayerEnvckptError as exc:
        checks["criu"] = {"ok": False, "detail": str(exc)}
    checks |= doctor_checks()
    if engine is not None:
        checks["restore engine"] = {"ok": True, "detail": restore_engine_line(engine.version())}
    for image in args.image or DEFAULT_IMAGES:
        present = engine is not None and engine.has_image(image)
        checks[f"image {image}"] = {
            "ok": present,
            "detail": "present" if present else "missing: run `bash scripts/setup-system` to build it",
        }
    ready = all(c["ok"] for c in checks.values())
    limits = SandboxLimits()
    warnings = engine_warnings(engine.info(), limits) if engine is not None else []
    if not args.json:
        for name, check in checks.items():
            print(f"{'ok ' if check['ok'] else 'BAD'} {name}: {check['detail']}")
        print(f"limits of every sandbox unless overridden: {_describe(limits)}")
        for warning in warnings:
            print(f"warn {warning}")
        print("ready" if ready else "not ready: fix the lines marked BAD")
    if engine is not None:
        engine.close()
    out = {"ready": ready, "checks": checks, "limits": limits.to_dict(), "warnings": warnings}
    return out, ExitCode.OK if ready else ExitCode.UNHEALTHY


def _describe(limits: SandboxLimits) -> str:
    def size(mb: int) -> str:
        return f"{mb} MB" if mb else "unlimited"

    return (
        f"pids {limits.pids or 'unlimited'}, memory {size(limits.memory_mb)} (no swap), "
        f"cpus {limits.cpus or 'unlimited'}, disk {size(limits.disk_mb)}, "
        f"checkpoint {size(limits.checkpoint_cap_mb)}, capabilities {','.join(limits.capabilities) or 'none'}, "
        f"no-new-privileges {'on' if limits.no_new_privileges else 'off'}, seccomp default"
    )


def _limits_from(args: argparse.Namespace) -> SandboxLimits:
    default = SandboxLimits()
    return SandboxLimits(
        pids=default.pids if args.pids is None else args.pids,
        memory_mb=default.memory_mb if args.memory_mb is None else args.memory_mb,
        cpus=default.cpus if args.cpus is None else args.cpus,
        disk_mb=default.disk_mb if args.disk_mb is None else args.disk_mb,
        checkpoint_mb=args.checkpoint_mb,
        capabilities=default.capabilities
        if args.cap is None
        else [c for c in args.cap if c.lower() != "none"],
        no_new_privileges=not args.allow_new_privileges,
    )


def _create(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    limits = _limits_from(args)
    labels = dict(item.split("=", 1) for item in args.label or [] if "=" in item)
    config = SandboxConfig(image=args.image, user=args.user, labels=labels, limits=limits)
    engine = Engine.connect()
    try:
        sandbox = Sandbox.create(engine, config, trajectory=args.trajectory)
        out = {"container_id": sandbox.id, "limits": limits.to_dict(), "enforced": sandbox.enforced_limits()}
    finally:
        engine.close()
    if not args.json:
        print(sandbox.id)
    return out, ExitCode.OK


def _checkpoint(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    engine = Engine.connect()
    sandbox = Sandbox.attach(engine, args.container, trajectory=args.trajectory, prefix=args.prefix)
    take = full_checkpoint if args.full else checkpoint
    ckpt = take(sandbox, args.trajectory, args.prefix, args.context_ref, store=CheckpointStore(args.store))
    out = _summary(ckpt) | {"timings_ms": ckpt.timings_ms}
    if not args.json:
        print(
            f"{ckpt.checkpoint_id} ready, {ckpt.kind} (freeze {out['freeze_ms']} ms, total {out['total_ms']} ms)"
        )
    return out, 0


def _restore(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    store = CheckpointStore(args.store)
    ckpt = store.get(args.trajectory, args.prefix)
    sandbox = full_restore(ckpt, remove_failed=not args.keep_failed)
    out = {
        "container_id": sandbox.id,
        "checkpoint_id": ckpt.checkpoint_id,
        "prefix": sandbox.prefix,
        "context_ref": sandbox.context_ref,
        "timings_ms": sandbox.restore_timings_ms,
        "images": sandbox.restore_images,
    }
    if not args.json:
        print(sandbox.id)
    return out, 0


def _ls(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    store = CheckpointStore(args.store)
    ready = [_summary(c) for c in store.list(args.trajectory)]
    leftovers = [str(p) for p in store.leftovers()]
    unreadable = {str(p): str(why) for p, why in store.unreadable(args.trajectory)}
    if not args.json:
        for c in ready:
            print(
                f"{c['trajectory']}\t{c['prefix']}\t{c['checkpoint_id']}\t{c['kind']}"
                f"{' of ' + c['artifacts_of'] if c['artifacts_of'] else ''}\t{c['bytes']} B\t{c['context_ref']}"
            )
        for p in leftovers:
            print(f"leftover (not ready): {p}")
        for p, why in unreadable.items():
            print(f"unreadable (skipped, gc keeps it): {p}: {why}")
    return {"checkpoints": ready, "leftovers": leftovers, "unreadable": unreadable}, 0


def _verify(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    store = CheckpointStore(args.store)
    ckpt = store.verify(store.get(args.trajectory, args.prefix))
    if not args.json:
        print(f"{ckpt.checkpoint_id} ok ({len(ckpt.files)} files, {ckpt.total_bytes} B)")
    return {"checkpoint_id": ckpt.checkpoint_id, "ok": True}, 0


def _gc(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    removed = [str(p) for p in CheckpointStore(args.store).gc(args.trajectory, keep=args.keep)]
    if not args.json:
        print(f"removed {len(removed)}")
    return {"removed": removed}, 0


def _demo(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    return run_demo(image=args.image, store_root=args.store, say=None if args.json else print), 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="belayer-envckpt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], tuple[dict[str, Any], int]], help_: str) -> Any:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        p.add_argument("--debug", action="store_true", help="print a traceback with an error")
        p.set_defaults(func=func)
        return p

    p = add("doctor", _doctor, "check engine, experimental mode, CRIU and images")
    p.add_argument("--image", action="append", help="image that must be present (repeatable)")
    p = add("create", _create, "create and start a sandbox (no network, no mounts) with its limits")
    p.add_argument("image")
    p.add_argument("--trajectory", default="")
    p.add_argument("--user", default="", help="user inside (default: the image's; see README on CRIU)")
    p.add_argument("--label", action="append", help="KEY=VALUE label on the container (repeatable)")
    p.add_argument("--pids", type=int, help="most processes and threads (0: no limit; default 512)")
    p.add_argument("--memory-mb", type=int, help="memory in MB, no swap (0: no limit; default 2048)")
    p.add_argument("--cpus", type=float, help="CPU quota in cores (0: no limit; default 1.0)")
    p.add_argument("--disk-mb", type=int, help="cap on the writable layer in MB (0: none; default 2048)")
    p.add_argument(
        "--checkpoint-mb", type=int, help="cap on one checkpoint in MB (default memory + disk + 256)"
    )
    p.add_argument(
        "--cap",
        action="append",
        help="a capability to keep (repeatable; replaces the default set; `none`: no capabilities)",
    )
    p.add_argument("--allow-new-privileges", action="store_true", help="do not set no-new-privileges")
    p = add("checkpoint", _checkpoint, "checkpoint a running container (the cheapest kind that captures it)")
    p.add_argument("container")
    p.add_argument("--full", action="store_true", help="always a full (CRIU) checkpoint")
    p.add_argument("--store", required=True)
    p.add_argument("--trajectory", required=True)
    p.add_argument("--prefix", type=int, required=True)
    p.add_argument("--context-ref", default="")
    p = add("restore", _restore, "restore the latest ready checkpoint into a new container")
    p.add_argument("--store", required=True)
    p.add_argument("--trajectory", required=True)
    p.add_argument("--prefix", type=int)
    p.add_argument("--keep-failed", action="store_true", help="do not remove the checkpointed container")
    p = add("ls", _ls, "list ready checkpoints and leftovers")
    p.add_argument("--store", required=True)
    p.add_argument("--trajectory")
    p = add("verify", _verify, "check a checkpoint's manifest and checksums")
    p.add_argument("--store", required=True)
    p.add_argument("--trajectory", required=True)
    p.add_argument("--prefix", type=int)
    p = add("gc", _gc, "remove leftovers, and a trajectory's checkpoints")
    p.add_argument("--store", required=True)
    p.add_argument("--trajectory")
    p.add_argument("--keep", type=int, help="keep the newest N ready checkpoints of each trajectory")
    p = add("demo", _demo, "checkpoint -> kill -> restore a sandbox, and show the state survived")
    p.add_argument("--image", default="belayer/debian-python:latest")
    p.add_argument("--store", default="")
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: typed errors become one line on stderr (and a JSON error with --json)."""
    args = build_parser().parse_args(argv)
    try:
        out, code = cast(Command, args.func)(args)
    except KeyboardInterrupt:
        print("belayer-envckpt: error: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BelayerEnvckptError as exc:
        # Bad input that started nothing: an unsafe id, a bad value, a name that names nothing.
        usage = isinstance(
            exc, InvalidIdError | InvalidConfigError | ContainerNotFoundError | CheckpointNotFoundError
        )
        if args.json:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        if args.debug or os.environ.get("BELAYER_DEBUG") == "1":
            traceback.print_exc()
        message = " ".join(str(exc).split())
        print(f"belayer-envckpt: error: {message} ({type(exc).__name__})", file=sys.stderr)
        return ExitCode.USAGE if usage else ExitCode.FAILED
    if args.json:
        print(json.dumps(out))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
