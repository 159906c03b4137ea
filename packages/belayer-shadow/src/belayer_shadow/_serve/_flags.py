"""The flags every command that serves a model folder shares (`belayer-shadow serve`,
`belayer-cluster serve`), named and meant as `vllm serve`'s where one exists, and the
`ServeConfig` they make. Each command adds its own beside them (`--run-dir` and `--backend` on one
machine; `--address` and `--shared-dir` on a Ray cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from belayer_shadow._serve._config import ServeConfig

__all__ = ["add_serve_flags", "serve_config_from_flags"]


def add_serve_flags(parser: argparse.ArgumentParser, *, where: str = "") -> None:
    """Add `MODEL_DIR` and the shared serving flags to `parser`. `where` ends the help of what
    must be present wherever slots run (" on every node"), empty on one machine."""
    parser.add_argument("model_dir", type=Path, help=f"a local Hugging Face model folder (Qwen3){where}")
    parser.add_argument("--slots", type=int, default=1, help="engine slots (each: main worker + shadow)")
    parser.add_argument(
        "--engine",
        choices=("belayer", "builtin", "vllm"),
        default="belayer",
        help=f"belayer (= builtin): the built-in engine; vllm: needs belayer-shadow[vllm]{where}",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the router's address (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (0 picks a free one)")
    parser.add_argument("--served-model-name", help="the model name of /v1/models (default: MODEL_DIR)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt (default: the model's)")
    parser.add_argument(
        "--recovery",
        choices=("shadow", "conventional", "restart"),
        default="shadow",
        help="what replaces a failed main worker: its shadow (default) or a restart",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks per slot")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="running requests per slot")
    parser.add_argument("--resume-wait-s", type=float, default=30.0, help="how long a cut request waits")
    parser.add_argument(
        "--hang-threshold-s", type=float, default=3.0, help="heartbeat age that counts as a hang"
    )
    parser.add_argument("--router-server", choices=("uvicorn", "belayer"), help="the router's HTTP server")
    parser.add_argument(
        "--api-key",
        nargs="+",
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $VLLM_API_KEY)",
    )
    parser.add_argument(
        "--seed", type=int, help="seed of requests that name none: same seed + same request, same tokens"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line when ready")


def serve_config_from_flags(args: argparse.Namespace, **fields: Any) -> ServeConfig:
    """The `ServeConfig` of the flags `add_serve_flags` added, with `fields` (a command's own:
    `run_dir`, `backend`) beside them. A value out of range raises `ValueError` naming the field."""
    from belayer_router import api_keys_from

    return ServeConfig(
        model_dir=args.model_dir,
        num_slots=args.slots,
        engine="belayer" if args.engine == "builtin" else args.engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        recovery=args.recovery,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        resume_wait_s=args.resume_wait_s,
        hang_threshold_s=args.hang_threshold_s,
        router_server=args.router_server,
        api_keys=api_keys_from(args.api_key),
        seed=args.seed,
        **fields,
    )
