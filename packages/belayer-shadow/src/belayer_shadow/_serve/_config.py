"""`ServeConfig`: everything `belayer-shadow serve` is started with; its flags map to it one to one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import attrs

__all__ = ["ServeConfig"]


def _key_tuple(keys: Iterable[str]) -> tuple[str, ...]:
    return tuple(keys)


def _optional_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


def _optional_positive(_inst: object, attr: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"ServeConfig.{attr.name} must be a positive int, got {value!r}")


@attrs.frozen
class ServeConfig:
    """One machine's rollout service: the router on `host:port` and `num_slots` slots.

    Names follow `vllm serve` where the meaning is the same: `served_model_name` (default: the
    model path as given), `max_model_len` (the longest prompt the
    router accepts; it must fit the model and one slot's KV pool; default: the smaller of the two). `run_dir` holds the
    slots' sockets, logs and event logs; without one a temporary folder is made and removed at the
    end (also after a SIGKILL of the command). `backend="cuda"` puts slot `i` on GPU `i`.
    `api_keys` and `seed` are the router's (`RouterConfig.api_keys`, `.seed`): `--api-key`, `--seed`.
    """

    model_dir: Path = attrs.field(converter=Path)
    num_slots: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    engine: Literal["belayer", "vllm"] = attrs.field(
        default="belayer", validator=attrs.validators.in_(("belayer", "vllm"))
    )
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    served_model_name: str | None = None
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive)
    run_dir: Path | None = attrs.field(default=None, converter=_optional_path)
    recovery: Literal["shadow", "conventional", "restart"] = attrs.field(
        default="shadow", validator=attrs.validators.in_(("shadow", "conventional", "restart"))
    )
    backend: Literal["host", "cuda"] = attrs.field(
        default="host", validator=attrs.validators.in_(("host", "cuda"))
    )
    num_kv_blocks: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    max_num_seqs: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    # A main worker whose heartbeat is older than this counts as hung (the shadow takes over).
    # Generous: on a loaded machine a busy worker must not pass for a hung one.
    hang_threshold_s: float = attrs.field(default=3.0, validator=attrs.validators.gt(0))
    resume_wait_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0))
    start_timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    router_server: str | None = None  # the router's HTTP server: uvicorn (default) or belayer
    # `vllm serve --api-key`: every route but /health then needs `Authorization: Bearer <key>`.
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_key_tuple)
    # `vllm serve --seed`: the seed of requests that name none, derived from it and the request
    # (belayer-router's `RouterConfig.seed`); None: a random seed each.
    seed: int | None = None

    @property
    def model_name(self) -> str:
        """The name `/v1/models` lists and requests name."""
        return self.served_model_name or str(self.model_dir)
