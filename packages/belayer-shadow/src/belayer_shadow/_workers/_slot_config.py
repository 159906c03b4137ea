"""`SlotConfig`: everything a slot supervisor is started with; the `belayer-shadow slot` flags map to it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

__all__ = ["Recovery", "SlotConfig"]

Recovery = Literal["shadow", "conventional", "restart"]


def _optional_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen
class SlotConfig:
    """One slot. `weights=None` writes a seeded init of the model to `run_dir/init.safetensors`.

    `backend` is the memory servers' (`host`: memfd; `cuda`: CUDA VMM on GPU `device`, which
    needs belayer-gpumem's `cuda` extra); the workers compute where the memory is.

    `recovery`: `shadow` (handover to the standby shadow worker), or one of the restart baselines:
    `conventional` (remote health checks, restart from scratch, regenerate) and `restart` (instant
    `waitpid` detection, restart from scratch, token-level resume through the router).
    `health_interval_s` x `health_misses` is the conventional baseline's detection (remote
    health checks, defaults like common trainers: 10 s x 3). `memory_check_s` x `memory_misses`
    bounds how long a hung (not exited) memory server goes unnoticed.
    """

    slot: str
    router_url: str
    run_dir: Path = attrs.field(converter=Path)
    admin_token: str | None = None
    model: Path | None = attrs.field(default=None, converter=_optional_path)
    weights: Path | None = attrs.field(default=None, converter=_optional_path)
    seed: int = 0
    backend: str = attrs.field(default="host", validator=attrs.validators.in_(("host", "cuda")))
    device: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    recovery: Recovery = attrs.field(
        default="shadow", validator=attrs.validators.in_(("shadow", "conventional", "restart"))
    )
    num_kv_blocks: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    max_num_seqs: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    failure_window_s: float = attrs.field(default=60.0, validator=attrs.validators.ge(0))
    poll_s: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))
    stale_s: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    health_interval_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    health_misses: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    # A memory server that exits is seen at once; one that misses `memory_misses` pings in
    # a row (one every `memory_check_s`, each waiting as long; 5 x 2 s: a loaded machine must not
    # pass for a hung server) is taken for hung. Either way the
    # slot restarts from scratch.
    memory_check_s: float = attrs.field(default=2.0, validator=attrs.validators.gt(0))
    memory_misses: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    # The handover flag up this long with the shadow still standing by: the shadow is hung; the slot
    # restarts from scratch.
    handover_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    # A standby shadow touches `run_dir/shadow.alive` at every poll and the guardian touches
    # `run_dir/guardian.alive` every 0.5 s; one whose file is older than this (a hang: SIGSTOP, a
    # stuck event loop) is SIGKILLed and replaced, before the main fails. Generous: on a loaded
    # machine a sleeping process may wait seconds for a core.
    standby_stale_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    host: str = "127.0.0.1"
    start_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
    # The workers' engine: `belayer` (built in) or `vllm` (a real vLLM; belayer-shadow[vllm]).
    engine: str = attrs.field(default="belayer", validator=attrs.validators.in_(("belayer", "vllm")))
