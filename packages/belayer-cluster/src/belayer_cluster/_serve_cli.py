"""`belayer-cluster serve MODEL_DIR`: `belayer-shadow serve` with its slots on a Ray cluster.

The flags of `belayer-shadow serve` but `--run-dir` and `--backend` (belayer-shadow's
`add_serve_flags`: `--slots`, `--engine`, `--host`, `--port`, `--served-model-name`,
`--max-model-len`, `--recovery`, `--num-kv-blocks`, `--block-size`, `--max-num-seqs`,
`--resume-wait-s`, `--hang-threshold-s`, `--router-server`, `--seed`, `--api-key`, `--json`),
plus `--address` (join that Ray cluster; without it a local one is started, and the command says
which on stderr) and `--shared-dir` (a folder every node reads at the same path: the slots' run
folders and the weights kept for replacements; default: a temporary folder, enough on one machine).
GPUs are not asked of Ray for slots (`--backend cuda` is belayer-shadow's, on one machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from belayer_cluster._errors import ClusterConfigError

__all__ = ["add_serve_parser", "run_serve"]

INTERRUPTED = 130


def add_serve_parser(commands: Any) -> None:
    """The `serve` subcommand's flags: belayer-shadow's shared serving flags and the cluster's."""
    from belayer_shadow import add_serve_flags

    serve = commands.add_parser(
        "serve",
        help="serve a model folder with its slots on a Ray cluster's nodes, until Ctrl-C / SIGTERM",
    )
    add_serve_flags(serve, where=" on every node")
    serve.add_argument("--address", help="the Ray GCS address, HOST:PORT (default: start a local cluster)")
    serve.add_argument("--shared-dir", type=Path, help="a folder every node reads (default: a temporary one)")
    serve.add_argument("--connect-timeout-s", type=float, default=10.0)


def run_serve(args: argparse.Namespace) -> int:
    """Check the folder, join (or start) Ray, serve until SIGINT / SIGTERM; exit 130."""
    import anyio

    from belayer_shadow import ModelFolder, serve_config_from_flags

    try:
        config = serve_config_from_flags(args)
    except (TypeError, ValueError) as exc:
        raise ClusterConfigError(str(exc)) from exc
    config.prompt_limit(ModelFolder.inspect(config.model_dir))  # a bad folder: nothing starts
    own_shared = args.shared_dir is None
    # Unix socket paths are short (107 bytes): so is the default shared folder.
    shared = Path(tempfile.mkdtemp(prefix="bcs-", dir="/tmp")) if own_shared else args.shared_dir
    local = None
    # Standard output is the command's own (the ready line, `--json`'s document first). Ray
    # forwards its raylets' and workers' lines to the driver's `sys.stdout` (a raylet marked dead
    # on a loaded machine came out before the ready line, breaking `--json`): they go to stderr.
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        local = _join_or_start(args, config.num_slots)
        return int(anyio.run(_serve, args, config, shared, local, out))
    finally:
        if local is not None:
            local.shutdown()
        else:
            from belayer_cluster._connect import disconnect

            disconnect()
        if own_shared:
            shutil.rmtree(shared, ignore_errors=True)
        sys.stdout = out  # after Ray is shut down (it may still print)


def _join_or_start(args: argparse.Namespace, num_slots: int) -> Any:
    """Join `--address` (None returned) or start a local cluster of one 1-CPU node per slot."""
    if args.address:
        from belayer_cluster._connect import connect

        connect(args.address, args.connect_timeout_s)
        print(f"belayer-cluster: joined the Ray cluster at {args.address}", file=sys.stderr, flush=True)
        return None
    from belayer_cluster._config import LocalClusterConfig
    from belayer_cluster._local import LocalRayCluster

    local = LocalRayCluster(LocalClusterConfig(num_nodes=num_slots, cpus_per_node=1)).start()
    print(
        f"belayer-cluster: no --address: started a local Ray cluster of {num_slots} simulated nodes "
        f"at {local.address} (stopped at exit)",
        file=sys.stderr,
        flush=True,
    )
    return local


async def _serve(args: argparse.Namespace, config: Any, shared: Path, local: Any, out: TextIO) -> int:
    import anyio

    from belayer_cluster._serve import ClusterService

    # A signal during the start is taken once the slots have started (or failed), then stops them.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with ClusterService.start(config, shared) as service:
            document = {
                "url": service.url,
                "openai_base_url": service.openai_base_url,
                "model": config.model_name,
                "slots": {slot: info.to_dict() for slot, info in service.slots.items()},
                "ray_address": local.address if local is not None else args.address,
                "local_cluster": local is not None,
                "shared_dir": str(shared),
            }
            line = f"belayer-cluster serving {config.model_name} at {service.url}"
            print(json.dumps(document) if args.json else line, file=out, flush=True)
            async for _ in signals:
                break
    return INTERRUPTED
