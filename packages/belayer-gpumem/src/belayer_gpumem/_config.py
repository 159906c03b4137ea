"""What a memory server is started with: one frozen value, shared by the CLI and `ServerProcess`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from belayer_gpumem._backends import BACKENDS
from belayer_gpumem._errors import LayoutError
from belayer_gpumem._layout import KVLayout

__all__ = ["READY_PREFIX", "Kind", "ServerConfig"]

Kind = Literal["weights", "kv"]
# The line a server prints on stdout once it accepts connections, followed by a JSON object.
READY_PREFIX = "BELAYER_GPUMEM_READY"


def _path_or_none(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen
class ServerConfig:
    """Configuration of one memory server.

    A weights server takes its table from `safetensors` (table and bytes, version 1) or from
    `layout_file` (a JSON table, zero-filled, version `start_version`, 0 by default; a client fills
    it with an update, which commits `start_version` + 1: a server restarted to hold weights of
    version N again starts at N - 1, so their refill brings it back to N).
    A KV server takes `kv_layout`.
    """

    kind: Kind = attrs.field(validator=attrs.validators.in_(("weights", "kv")))
    socket: Path = attrs.field(converter=Path)
    backend: str = attrs.field(default="host", validator=attrs.validators.in_(BACKENDS))
    device: int = 0
    safetensors: Path | None = attrs.field(default=None, converter=_path_or_none)
    layout_file: Path | None = attrs.field(default=None, converter=_path_or_none)
    kv_layout: KVLayout | None = None
    ready_file: Path | None = attrs.field(default=None, converter=_path_or_none)
    pid_file: Path | None = attrs.field(default=None, converter=_path_or_none)
    start_version: int = 0

    def __attrs_post_init__(self) -> None:
        if self.start_version < 0:
            raise LayoutError(f"--start-version must be 0 or more, got {self.start_version}")
        if self.kind == "weights":
            if (self.safetensors is None) == (self.layout_file is None):
                raise LayoutError("a weights server needs exactly one of --safetensors or --layout")
            if self.kv_layout is not None:
                raise LayoutError("a weights server takes no KV layout")
            if self.start_version and self.layout_file is None:
                raise LayoutError(
                    "--start-version needs --layout (a --safetensors server starts at version 1)"
                )
        elif self.kv_layout is None or self.safetensors is not None or self.layout_file is not None:
            raise LayoutError("a kv server needs the KV layout (--num-blocks ...) and no weight source")
        elif self.start_version:
            raise LayoutError("a kv server has no weight version: drop --start-version")

    def to_argv(self) -> list[str]:
        """The `belayer-gpumem serve ...` arguments that reproduce this configuration."""
        argv = ["serve", "--kind", self.kind, "--socket", str(self.socket), "--backend", self.backend]
        argv += ["--device", str(self.device)]
        for flag, path in (
            ("--safetensors", self.safetensors),
            ("--layout", self.layout_file),
            ("--ready-file", self.ready_file),
            ("--pid-file", self.pid_file),
        ):
            if path is not None:
                argv += [flag, str(path)]
        if self.start_version:
            argv += ["--start-version", str(self.start_version)]
        if self.kv_layout is not None:
            kv = self.kv_layout
            argv += ["--num-blocks", str(kv.num_blocks), "--num-layers", str(kv.num_layers)]
            argv += ["--block-size", str(kv.block_size), "--num-kv-heads", str(kv.num_kv_heads)]
            argv += ["--head-dim", str(kv.head_dim), "--dtype", kv.dtype]
        return argv
